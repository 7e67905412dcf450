"""Generate shoal.v1 (messages, gRPC stubs and mypy stubs) from protos/ into clients/src.

    python tools/gen_protos.py           # regenerate
    python tools/gen_protos.py --check   # exit 1 if the committed code is stale

The generated files are committed so that `pip install shoal-client` needs no protoc.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "clients" / "src"
PACKAGE_DIR = Path("shoal") / "v1"
INIT = '"""shoal.v1: generated from protos/shoal/v1 by tools/gen_protos.py. Do not edit."""\n'
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_root: Path) -> None:
    protos = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto")
    )
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    well_known = Path(protoc.__file__).parent / "_proto"
    # protoc finds the mypy plugins (protoc-gen-mypy, protoc-gen-mypy_grpc) on PATH.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_root / PACKAGE_DIR / "__init__.py").write_text(INIT)
    (out_root / PACKAGE_DIR / "py.typed").write_text("")


def generated_files(root: Path) -> set[str]:
    pkg = root / PACKAGE_DIR
    return {
        p.name
        for p in pkg.iterdir()
        if p.name.endswith(GENERATED_SUFFIXES) or p.name in ("__init__.py", "py.typed")
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    ns = parser.parse_args()
    if not ns.check:
        pkg = OUT_ROOT / PACKAGE_DIR
        if pkg.exists():
            for name in generated_files(OUT_ROOT):
                (pkg / name).unlink()
        generate(OUT_ROOT)
        print(f"generated {len(generated_files(OUT_ROOT))} files in {OUT_ROOT / PACKAGE_DIR}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        want, have = generated_files(fresh), generated_files(OUT_ROOT)
        stale = sorted(want ^ have)
        stale += sorted(
            n
            for n in want & have
            if not filecmp.cmp(fresh / PACKAGE_DIR / n, OUT_ROOT / PACKAGE_DIR / n, shallow=False)
        )
        if stale:
            print("stale generated code (run `make protos`): " + ", ".join(stale), file=sys.stderr)
            return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
