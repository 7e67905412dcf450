"""The messages a learner exchanges with its job's coordinator, built and read by pure functions
that both backends on the parameter-sync shards use (``grpc_backend.py``, ``collective.py``):
the tensor layout and the Join a learner sends, the plan its reply puts in force, the Boundary
that reports an iteration, and the trainer's :class:`~shoal.learner.backend.Assignment` read
from the answer. No I/O here: the calls go through
:class:`~shoal.learner.shard_session.ShardSession`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shoal.contract.wire import TensorMeta, pack_layout
from shoal.learner.grpc_calls import optimizer_proto
from shoal.learner.sync_types import Assignment, TrainingPlan, TrainingSetup
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

__all__ = [
    "UserMetrics",
    "adopted_plan",
    "assignment_of",
    "boundary_request",
    "join_request",
    "layout_of",
]

#: What the script logged with ``trainer.log`` for one step: (step, name -> (sum, samples)).
UserMetrics = tuple[int, Mapping[str, tuple[float, int]]]


def layout_of(setup: TrainingSetup) -> list[TensorMeta]:
    """The job's tensors as this learner lays them out: parameters, then buffers."""
    metas = [
        TensorMeta(s.name, s.dtype, tuple(s.shape), 0, s.nbytes, False) for s in setup.param_specs
    ] + [TensorMeta(s.name, s.dtype, tuple(s.shape), 0, s.nbytes, True) for s in setup.buffer_specs]
    layout, _ = pack_layout(metas)
    return layout


def join_request(
    job_id: str,
    learner_id: str,
    layout: Sequence[TensorMeta],
    setup: TrainingSetup,
    sync_mode: int,
    **fields: Any,
) -> ps_pb2.JoinRequest:
    """This learner's Join in ``sync_mode`` (the first Join fixes the job's), with the more
    ``fields`` of its backend (the collective backend's state)."""
    return ps_pb2.JoinRequest(
        job_id=job_id,
        learner_id=learner_id,
        layout=[m.to_proto() for m in layout],
        optimizer=optimizer_proto(setup),
        dataset_size=setup.plan.num_samples,
        sync_mode=sync_mode,  # type: ignore[arg-type]
        **fields,
    )


def adopted_plan(reply: ps_pb2.JoinResponse, plan: TrainingPlan) -> TrainingPlan:
    """The plan in force: the job's settings (from the Join reply) win over the script's."""
    return TrainingPlan(
        epochs=reply.epochs,
        batch_size=reply.batch_size,
        num_samples=plan.num_samples,
        seed=int(reply.seed),
        checkpoint_every=plan.checkpoint_every,
        max_workers=plan.max_workers,
    )


def boundary_request(
    job_id: str,
    learner_id: str,
    user: UserMetrics,
    generation: int,
    completed: int = -1,
    loss_sum: float = 0.0,
    n: int = 0,
    **extra: Any,
) -> ps_pb2.BoundaryRequest:
    """A learner's Boundary, reporting ``completed`` (-1: none) of ``generation``, with what
    the script logged for that iteration (``user``)."""
    step, logged_at = user
    logged = logged_at if completed >= 0 and completed == step else {}
    return ps_pb2.BoundaryRequest(
        job_id=job_id,
        learner_id=learner_id,
        generation=generation,
        completed_iteration=completed,
        loss_sum=loss_sum,
        num_samples=n,
        metric_sums={name: total for name, (total, _) in logged.items()},
        metric_samples={name: count for name, (_, count) in logged.items()},
        **extra,
    )


def assignment_of(
    reply: ps_pb2.BoundaryResponse, plan: TrainingPlan, last: tuple[int, int]
) -> Assignment | None:
    """A RUN, RETIRE or DONE answer as the trainer's :class:`Assignment` (None: done).
    ``last`` is the (generation, iteration) this learner last reported: a retirement follows
    it."""
    if reply.action == ps_pb2.BOUNDARY_ACTION_DONE:
        return None
    if reply.action == ps_pb2.BOUNDARY_ACTION_RETIRE:
        return Assignment.retirement(last[0], last[1] + 1)
    if reply.action != ps_pb2.BOUNDARY_ACTION_RUN:
        raise RuntimeError(f"unknown boundary action {reply.action}")
    a = reply.assignment
    # A coordinator that sends the global batch sends where it starts (positions are kept
    # in samples: with an adaptive batch it is not iteration x B).
    start = int(a.batch_start) if a.global_batch else a.iteration * plan.batch_size
    assignment = Assignment(
        generation=int(a.generation),
        epoch=a.epoch,
        iteration=a.iteration,
        step=int(a.global_iteration),
        rank=a.rank,
        world_size=a.world_size,
        batch_start=start,
        batch_stop=start + a.batch_samples,
        pull_parameters=reply.pull_parameters,
        global_batch=a.global_batch,
        gradient_noise_scale=a.gradient_noise_scale,
    )
    if assignment.share != (a.sample_start, a.sample_end):
        raise RuntimeError(
            f"coordinator's sample range [{a.sample_start}, {a.sample_end}) differs from "
            f"the partition's {assignment.share} (rank {a.rank} of {a.world_size})"
        )
    return assignment
