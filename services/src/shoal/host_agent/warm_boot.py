"""The program that runs a learner's ``.py`` entry point (as ``python -c <this file's source>``),
warm or cold.

**Warm** (no arguments): it imports what every learner imports (torch, the learner package),
tells the agent it is ready (:data:`READY` on stdout), then waits on stdin for exactly one job:
one JSON line ``{"argv": [python, script, *args], "env": {...}, "cwd": "..."}``, which it
acknowledges (:data:`TAKEN` on stdout: the agent knows it is alive and the learner). It then
becomes that learner: the environment is replaced by the job's, stdin is /dev/null, the working
directory and ``sys.argv``/``sys.path[0]`` are those of ``python script args``, and the script
runs as ``__main__``. A warm process serves one learner and never another: no job's code, data
or credential exists in it before the line arrives, and it exits with the learner. stdin closed
without a line (the agent retires the process): exit 0 at once.

**Cold** (``--run script args...``): the agent started it with the job's environment and
working directory; the script runs as ``__main__`` the same way, without the preload.

**Exit** (both): an uncaught exception prints its traceback and exits 1, ``sys.exit(n)`` exits
n, as ``python script`` would. What the interpreter does at exit is done: non-daemon threads are
joined (``threading._shutdown``, which also ends thread-pool executors), ``atexit`` handlers
run, every file the script opened for writing (``open``, tracked weakly) and left open is
flushed, stdout and stderr too (and C stdio, ``fflush(NULL)``); then the process ends with
``os._exit`` instead of tearing down every module (1-2.5 s for a process with torch loaded on a
busy 2-core machine, seconds that a retired learner's device would stay busy). A job that needs
the full teardown (``__del__`` side effects at exit) sets ``LEARNER_FULL_EXIT=1``.
KeyboardInterrupt keeps Python's own handling. One thing finalization does is skipped: torch's
operator libraries unregistering themselves (:func:`_skip_torch_library_finalizers`).

Nothing here touches CUDA: ``CUDA_VISIBLE_DEVICES`` of the job's device, read when CUDA is first
initialized, is part of the job's environment.

No import of the host agent: this runs in the learner's interpreter.
"""

import os
import runpy
import sys
import threading
import weakref

READY = "\0shoal-warm-ready"
TAKEN = "\0shoal-warm-taken"  # the job's line arrived: the agent now counts it as the learner
RUN = "--run"  # a cold start: ``--run script args...``
FULL_EXIT_ENV = "LEARNER_FULL_EXIT"


def _preload() -> None:
    import torch  # noqa: F401  (the point: paid before the job arrives)

    import shoal.learner  # noqa: F401


def _become(spec: dict) -> list[str]:
    argv = [str(a) for a in spec["argv"]]
    env = {str(k): str(v) for k, v in spec["env"].items()}
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return argv[1:]


_written: weakref.WeakSet = weakref.WeakSet()  # files the script opened for writing


def _track_open() -> None:
    """Remember the files the script opens for writing (``open``, ``io.open``, ``Path.open``,
    ``os.fdopen``), weakly, so that the exit can flush those it left open, as finalization
    would have, without scanning every object of the process (a second and more on a busy
    machine)."""
    import builtins
    import io

    real = io.open

    def open(file, mode="r", *args, **kwargs):  # the point: replace open
        handle = real(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            try:
                _written.add(handle)
            except TypeError:
                pass
        return handle

    open.__doc__ = real.__doc__
    builtins.open = io.open = open


def _flush_open_files() -> None:
    """Flush what finalization would have (files the script left open)."""
    for handle in list(_written):
        try:
            if not handle.closed:
                handle.flush()
        except Exception:
            pass


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: what C code printed with stdio (block-buffered on a pipe), which
    ``exit()`` would flush and ``os._exit`` does not."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass


def _skip_torch_library_finalizers() -> None:
    """``torch.library`` registers a ``weakref.finalize`` (``atexit=True``) per operator
    library, which unregisters its operators at exit: in-process bookkeeping that ``os._exit``
    makes moot, and 30 ms of a retired learner's exit on an idle 2-core machine, 100 ms and more
    under load (measured: bench/RESULTS-retire.md). Those are the only finalizers skipped: the
    script's own, tempfile's and every other library's still run."""
    library = sys.modules.get("torch.library")
    func = getattr(library, "_del_library", None)
    if func is None:
        return
    import weakref

    for ref, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
        if getattr(info, "func", None) is func:
            ref.atexit = False


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_traceback(exc: BaseException, script: str) -> None:
    """The traceback ``python script`` prints: from the script's first frame (not this
    runner's nor runpy's), so the exit reason names the script's own lines."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    if tb is not None:
        exc = exc.with_traceback(tb)  # the default hook prints the exception's own traceback
    sys.excepthook(type(exc), exc, exc.__traceback__)


def _run(argv: list[str]) -> None:
    script = argv[0]
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    shutdown = getattr(threading, "_shutdown", None)
    full = os.environ.get(FULL_EXIT_ENV, "") not in ("", "0") or shutdown is None
    if not full:
        _track_open()
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        if full:
            raise
        code = _exit_code(exc)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        _print_traceback(exc, script)
        code = 1
    if full:
        sys.exit(code)  # the interpreter's own teardown
    assert shutdown is not None
    try:
        shutdown()
        import atexit

        _skip_torch_library_finalizers()
        atexit._run_exitfuncs()
        _flush_open_files()
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()
        _flush_c_stdio()
    finally:
        os._exit(code)


def main() -> None:
    if sys.argv[1:2] == [RUN]:
        _run(sys.argv[2:])
        return
    import json

    _preload()
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        sys.exit(0)
    spec = json.loads(line)
    sys.stdout.write(TAKEN + "\n")
    sys.stdout.flush()
    _run(_become(spec))


if __name__ == "__main__":
    main()
