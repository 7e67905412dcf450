"""The fast exit skips torch's operator-library finalizers (moot before ``os._exit``, and tens to
hundreds of milliseconds of a retired learner's exit) and nothing else."""

from __future__ import annotations

import weakref

import torch.library

from shoal.host_agent import warm_boot


class Thing:
    pass


def test_only_torchs_library_finalizers_are_skipped_at_the_fast_exit():
    thing = Thing()
    user = weakref.finalize(thing, print, "the script's own finalizer")
    torch_func = torch.library._del_library
    torchs = [ref for ref, info in weakref.finalize._registry.items() if info.func is torch_func]
    assert torchs and all(ref.atexit for ref in torchs)
    try:
        warm_boot._skip_torch_library_finalizers()
        assert not any(ref.atexit for ref in torchs)
        assert user.atexit and user.alive
    finally:
        for ref in torchs:  # this test process exits normally: leave torch as it was
            ref.atexit = True
        user.detach()
