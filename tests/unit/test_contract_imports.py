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


def test_the_parameter_sync_service_imports_nothing_of_the_learner_package() -> None:
    # The tensor wire codec both sides speak lives in shoal.contract.wire (issue 12).
    code = (
        "import sys, shoal.param_sync.service, shoal.param_sync.main\n"
        "print(','.join(sorted(n for n in sys.modules if n.startswith('shoal.learner'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == "", f"shoal.param_sync imported {out}"


def test_the_learner_transport_alias_re_exports_the_wire_codec() -> None:
    import shoal.contract.wire as wire
    import shoal.learner.transport as transport

    for name in wire.__all__:
        assert getattr(transport, name) is getattr(wire, name), name
