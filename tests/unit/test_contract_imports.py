"""The shared contract package stays importable without grpc and torch."""

import subprocess
import sys

import shoal.contract


def test_the_contract_package_imports_neither_grpc_nor_torch() -> None:
    code = (
        "import pkgutil, sys, importlib, shoal.contract as c\n"
        "for m in pkgutil.iter_modules(c.__path__):\n"
        "    importlib.import_module(f'shoal.contract.{m.name}')\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('grpc', 'torch'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == "", f"shoal.contract imported {out}"
    assert shoal.contract.__doc__
