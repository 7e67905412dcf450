"""``shoal-service NAME [flags]``: run one shoal service process.

NAME is one of resource-manager, job-scheduler, parameter-sync, host-agent; each lives in its
package's ``main`` module with a ``main(argv) -> int`` function (also runnable as
``python -m shoal.<package>``). ``shoal-service NAME --help`` lists the service's flags.

``shoal-service auth ...`` manages the users and learner keys in etcd
(``shoal.runtime.auth_admin``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence

from shoal.contract import environment

PACKAGES = {
    "resource-manager": "shoal.resource_manager",
    "job-scheduler": "shoal.scheduler",
    "parameter-sync": "shoal.param_sync",
    "host-agent": "shoal.host_agent",
}
SERVICES = tuple(PACKAGES)
#: What the data-plane services import beyond the control plane's packages: the extra
#: ``shoal-services[dataplane]`` (the control-plane image, Dockerfile target ``control``, has none).
DATA_PLANE = {
    "parameter-sync": ("torch", "numpy", "safetensors"),
    # the agent itself needs none, but every learner it starts runs shoal.learner (and torch)
    "host-agent": ("shoal.learner", "torch"),
}
#: Operator commands beside the services: NAME -> module with ``main(argv) -> int``.
COMMANDS = {"auth": "shoal.runtime.auth_admin"}


def configure_logging(service: str) -> None:
    logging.basicConfig(
        level=os.environ.get(environment.LOG_LEVEL, "INFO").upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )


def missing_packages(service: str) -> list[str]:
    """The modules ``service`` needs that this environment cannot import."""
    missing = []
    for module in DATA_PLANE.get(service, ()):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return int(importlib.import_module(COMMANDS[args[0]]).main(args[1:]) or 0)
    if not args or args[0] in ("-h", "--help") or args[0] not in SERVICES:
        print(f"usage: shoal-service {{{','.join(SERVICES)}}} [flags]", file=sys.stderr)
        if args and args[0] not in ("-h", "--help"):
            print(f"shoal-service: unknown service {args[0]!r}", file=sys.stderr)
            return 2
        return 0 if args else 2
    name, rest = args[0], args[1:]
    missing = missing_packages(name)
    if missing:
        print(
            f"shoal-service: {name} needs {', '.join(missing)}, which this environment lacks "
            "(the control-plane image has no data plane): install 'shoal-services[dataplane]' "
            'or use the full image (Dockerfile target "full", the default)',
            file=sys.stderr,
        )
        return 2
    configure_logging(name)
    module = importlib.import_module(f"{PACKAGES[name]}.main")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
