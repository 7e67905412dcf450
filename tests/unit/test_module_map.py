"""docs/architecture.md lists every module of the three distributions, and no module that is
gone (tools/module_map.py; module names only, so rewording a docstring never fails it)."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("module_map", ROOT / "tools" / "module_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_page_maps_every_module_and_only_those() -> None:
    missing, gone = _tool().differences()
    fix = "run: python tools/module_map.py --write"
    assert missing == [], f"not in docs/architecture.md's module map: {missing}; {fix}"
    assert gone == [], f"docs/architecture.md maps modules that are gone: {gone}; {fix}"


def test_the_map_has_one_line_per_module_with_what_it_is() -> None:
    lines = [ln for ln in _tool().module_map().splitlines() if ln.startswith("- `")]
    names = [ln.split("`")[1] for ln in lines]
    assert len(names) == len(set(names))
    assert "shoal.contract.errors" in names and "shoal.scheduler.reconcile.decide" in names
    undocumented = [ln for ln in lines if ln.endswith("— ")]
    assert undocumented == [], f"modules without a docstring: {undocumented}"
