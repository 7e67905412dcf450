"""The control plane runs without the data plane's packages (the Dockerfile's ``control``
image): the resource manager, the scheduler, the dashboard, the CLI and ``shoal-service auth``
import and start with torch, numpy, safetensors and shoal.learner absent; parameter-sync and the
host agent refuse to start there with an error naming what is missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BLOCKED = ("torch", "numpy", "safetensors", "shoal.learner")

# A meta-path finder that makes the data plane's packages unimportable, as in an environment
# where they were never installed.
PRELUDE = textwrap.dedent(
    f"""
    import sys

    BLOCKED = {BLOCKED!r}

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    """
)


def _run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_control_plane_imports_and_parses_its_flags_without_torch():
    proc = _run(
        """
        import importlib
        for module in ("shoal.scheduler.main", "shoal.resource_manager.main",
                       "shoal.dashboard.app", "shoal.cli.main", "shoal.runtime.auth_admin"):
            importlib.import_module(module)
        from shoal.runtime.main import main
        for service in ("job-scheduler", "resource-manager"):
            try:
                main([service, "--help"])
            except SystemExit as exit_:
                assert exit_.code == 0, (service, exit_.code)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
        print("LOADED", loaded)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("service", "names"),
    [("parameter-sync", "torch, numpy, safetensors"), ("host-agent", "shoal.learner, torch")],
)
def test_a_data_plane_service_without_its_packages_says_what_to_install(service, names):
    proc = _run(
        f"""
        from shoal.runtime.main import main
        sys.exit(main([{service!r}, "--help"]))
        """
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"{service} needs {names}" in proc.stderr, proc.stderr
    assert "shoal-services[dataplane]" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
