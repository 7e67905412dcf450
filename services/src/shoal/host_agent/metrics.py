"""The host agent's metrics (see docs/operations.md, "Reading metrics").

=========================  ===========  ====================================================
metric                     labels       meaning
=========================  ===========  ====================================================
``shoal_host_learners``    host, state  learner processes this agent knows, by state
                                        (STARTING, RUNNING, STOPPING, SUCCEEDED, FAILED;
                                        exited ones until they are forgotten)
``shoal_host_devices``     host         devices (GPUs, or simulated ones) this agent offers
=========================  ===========  ====================================================
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from shoal.runtime.metrics import meter, observer
from shoal.v1 import resources_pb2

if TYPE_CHECKING:
    from shoal.host_agent.service import HostAgent

__all__ = ["learner_counts", "register_metrics"]

Point = tuple[float, Mapping[str, str]]

_STATES = (
    resources_pb2.LEARNER_STATE_STARTING,
    resources_pb2.LEARNER_STATE_RUNNING,
    resources_pb2.LEARNER_STATE_STOPPING,
    resources_pb2.LEARNER_STATE_SUCCEEDED,
    resources_pb2.LEARNER_STATE_FAILED,
)


def _state_name(state: int) -> str:
    return resources_pb2.LearnerState.Name(state).removeprefix("LEARNER_STATE_")  # type: ignore[arg-type]


def learner_counts(agent: HostAgent) -> dict[str, int]:
    """Learners of this host by state name, every state present."""
    counts = {_state_name(state): 0 for state in _STATES}
    for learner in agent.processes.learners():
        name = _state_name(learner.state)
        counts[name] = counts.get(name, 0) + 1
    return counts


def register_metrics(agent: HostAgent) -> None:
    """Create the host agent's instruments over ``agent`` (once per process)."""
    m = meter(__name__)
    host = agent.config.host_id

    def learners() -> Iterator[Point]:
        for state, count in learner_counts(agent).items():
            yield float(count), {"host": host, "state": state}

    m.create_observable_gauge(
        "shoal_host_learners",
        callbacks=[observer(learners, what="shoal_host_learners")],
        description="Learner processes of this host by state",
    )
    m.create_observable_gauge(
        "shoal_host_devices",
        callbacks=[observer(lambda: [(float(len(agent.devices)), {"host": host})])],
        description="Devices (GPUs, or simulated ones) this host agent offers",
    )
