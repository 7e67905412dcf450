"""The program of a warm learner process (run as ``python -c <this file's source>``).

It imports what every learner imports (torch, the learner package), tells the agent it is
ready (:data:`READY` on stdout), then waits on stdin for exactly one job: one JSON line
``{"argv": [python, script, *args], "env": {...}, "cwd": "..."}``, which it acknowledges
(:data:`TAKEN` on stdout: the agent knows it is alive and the learner). It then becomes that
learner: the environment is replaced by the job's, stdin is /dev/null, the working directory and
``sys.argv``/``sys.path[0]`` are those of ``python script args``, and the script runs as
``__main__``. An uncaught exception prints its traceback and exits 1, ``sys.exit(n)`` exits n,
as a cold ``python script`` would. A warm process serves one learner and never another: no job's
code, data or credential exists in it before the line arrives, and it exits with the learner.
stdin closed without a line (the agent retires the process): exit 0 at once.

Nothing here touches CUDA: ``CUDA_VISIBLE_DEVICES`` of the job's device, read when CUDA is first
initialized, is part of the job's environment.

No import of the host agent: this runs in the learner's interpreter.
"""

import json
import os
import runpy
import sys

READY = "\0shoal-warm-ready"
TAKEN = "\0shoal-warm-taken"  # the job's line arrived: the agent now counts it as the learner


def _preload() -> None:
    import torch  # noqa: F401  (the point: paid before the job arrives)

    import shoal.learner  # noqa: F401


def _become(spec: dict) -> None:
    argv = [str(a) for a in spec["argv"]]
    env = {str(k): str(v) for k, v in spec["env"].items()}
    script = argv[1]
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    _preload()
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        sys.exit(0)
    spec = json.loads(line)
    sys.stdout.write(TAKEN + "\n")
    sys.stdout.flush()
    _become(spec)


if __name__ == "__main__":
    main()
