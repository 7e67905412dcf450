"""Shared by every test: the user's config directory is a temporary one, so `shoal cluster up`
(which registers a context in ``$XDG_CONFIG_HOME/shoal/contexts.json``) never writes into the
real ``~/.config`` of whoever runs the suite."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Host agents started by tests (a LocalCluster's, ShoalProcesses') keep no warm learner processes
# unless a test asks for them (HostAgentConfig.warm_learners, ClusterSpec.warm_learners): each
# one imports torch, and the suite shares 2 cores. Set here, at collection, so that clusters of
# module-scoped fixtures get it too; a value already in the environment wins. Warm learners have
# their own tests (test_warm_learners, test_host_agent_fast_path).
os.environ.setdefault("SHOAL_WARM_LEARNERS", "0")

# No test asserts wall-clock speed: hypothesis's per-example deadline (200 ms) is one, and it
# fails property tests on a loaded 2-core CI machine. Examples are still bounded by max_examples.
settings.register_profile("shoal", deadline=None)
settings.load_profile("shoal")


@pytest.fixture(autouse=True)
def _isolated_user_config(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    monkeypatch.delenv("SHOAL_CONTEXT", raising=False)
