"""shoal.host_agent: one per host. Discovers the host's devices (:mod:`.devices`), registers and
heartbeats to the resource manager, and starts, stops and watches learner processes pinned to
the devices (:mod:`.processes`); :mod:`.service` serves HostAgentService; ``main`` runs it."""
