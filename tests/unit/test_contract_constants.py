"""The etcd key schema and the learner's environment variable names are each spelled once, in
shoal.contract.keys and shoal.contract.environment; the modules that write and read them use
those constants (issue 15)."""

from __future__ import annotations

import ast
import pathlib

from shoal.contract import environment, keys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [ROOT / d / "src" for d in ("clients", "learner", "services")]


def _string_literals(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every string constant of a module except docstrings (and f-string parts)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and id(node) not in in_fstrings
    ]


def test_no_module_but_the_key_schema_spells_an_etcd_key() -> None:
    schema = ROOT / "clients/src/shoal/contract/keys.py"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for src in SOURCES
        for path in sorted(src.rglob("*.py"))
        if path != schema and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        for line, text in _string_literals(path)
        if text.startswith("/shoal/v1/")
    ]
    assert found == [], "use shoal.contract.keys:\n" + "\n".join(found)


def test_the_key_schema_nests_every_prefix_under_one_root() -> None:
    prefixes = [getattr(keys, n) for n in keys.__all__ if n.isupper()]
    assert all(p.startswith(keys.ROOT) and p.endswith("/") for p in prefixes)
    assert keys.shard_key(3) == "/shoal/v1/parameter-sync/shards/3"
    assert keys.election_prefix("job-scheduler") == "/shoal/v1/election/job-scheduler/"


def test_the_learner_contract_is_written_and_read_through_the_constants() -> None:
    writer = ROOT / "services/src/shoal/scheduler/reconcile/rules.py"
    reader = ROOT / "learner/src/shoal/learner/env.py"
    names = environment.LEARNER_VARIABLES | {environment.LOG_LEVEL}
    for path in (writer, reader):
        spelled = [t for _, t in _string_literals(path) if t in names]
        assert spelled == [], f"{path.name} spells {spelled}: use shoal.contract.environment"
    text = reader.read_text()
    unread = sorted(
        n
        for n in environment.__all__
        if getattr(environment, n) in environment.LEARNER_VARIABLES
        and f"environment.{n}" not in text
        and n != "COLLECTIVE_TIMEOUT_S"  # read by the collective backend itself
    )
    assert unread == [], f"shoal.learner.env does not read {unread}"
    assert all(v.startswith(environment.PREFIX) for v in names)
