"""The ``"collective"`` sync backend: learners all-reduce their gradients in a torch.distributed
process group (NCCL when every member has a CUDA device, gloo otherwise) and each steps its own
optimizer; the coordinator (on parameter-sync shard 0) still runs every boundary.

Per learner (docs/data-plane.md, "Collective mode"):

* :meth:`CollectiveBackend.initialize` joins the job in COLLECTIVE mode. The learner keeps the
  model's own parameter tensors and an optimizer over them: there is no copy of the state
  anywhere else, except in checkpoints.
* :meth:`CollectiveBackend.next_assignment` asks the coordinator for the next iteration. When
  the generation changed, the old group is torn down and a new one formed *in this process*:
  rendezvous through the coordinator-hosted TCPStore under ``<prefix>/g<generation>/`` (the
  prefix is the job's secret from JoinResponse.rendezvous_prefix: the store has no TLS and
  no access control, so only the job's learners know where its keys are), then the
  members that do not hold the state (joiners) receive the parameters, buffers and optimizer
  state by broadcast from the lowest rank that does. When no member holds it (every holder
  died), rank 0 loads the checkpoint the coordinator names and broadcasts it.
* :meth:`CollectiveBackend.sync` all-reduces ``n_i * g_i`` in buckets with the sample counts,
  loss sums and buffers (so the result is exactly the parameter-server weighting,
  :func:`~shoal.learner.backend.reduce_contributions`), then votes at the coordinator. With
  overlap (the default, :meth:`CollectiveBackend.overlap_hooks`), the gradient buckets were
  already sent by autograd hooks while backward ran (:mod:`shoal.learner.overlap`); sync
  waits for them with the rest. The
  update is applied only once the coordinator says the iteration committed (every member's
  all-reduce succeeded); until then it is pending, so an abort needs no rollback of the
  parameters or optimizer (the trainer restores the buffers the forward passes touched).
* A collective that fails (a peer died: gloo sees the socket close at once; a peer hangs: the
  explicit timeout, ``SHOAL_COLLECTIVE_TIMEOUT_S``, default 30 s) is reported; the coordinator
  aborts the iteration and re-freezes the survivors in a new generation, which re-forms.
* The coordinator's shard lost (docs/data-plane.md, "Coordinator failover in collective
  mode"): the learner follows the move as the grpc backend does (both hold a
  :class:`~shoal.learner.shard_session.ShardSession`, which follows it), its re-Join says
  what it holds (``collective_state``), and the next generation re-forms through the
  successor's store, keeping model and optimizer; the pending update is applied or dropped by
  the next answer.
* Checkpoints: a learner holding the state is asked (``CHECKPOINT``) to write it as one shard
  file in the parameter-server checkpoint format; the coordinator writes the manifest, so
  checkpoints of either mode restore in either mode (the file format:
  :mod:`shoal.learner.collective_checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shoal.contract import environment, faults
from shoal.contract.wire import TensorMeta
from shoal.learner.backend import (
    Assignment,
    Contribution,
    EpochReport,
    InitialState,
    IterationAborted,
    ModelState,
    SyncBackend,
    SyncResult,
    TrainingPlan,
    TrainingSetup,
    apply_gradient_policy,
    register_backend,
    registered_backends,
    set_learning_rate,
)
from shoal.learner.collective_ahead import AHEAD_MAX_BYTES, StateCopy, state_bytes
from shoal.learner.collective_checkpoint import (
    CHECKPOINT_FILE,
    encode_checkpoint,
    load_checkpoint,
    write_checkpoint_file,
)
from shoal.learner.collective_group import (
    CollectiveError,
    CollectiveGroup,
    counts_ride,
    first_line,
    reduce_contribution,
)
from shoal.learner.coordinator_messages import (
    UserMetrics,
    adopted_plan,
    assignment_of,
    boundary_request,
    join_request,
    layout_of,
)
from shoal.learner.env import LearnerEnv, switch
from shoal.learner.grpc_backend import session_options
from shoal.learner.grpc_lane import DirectControl, lane_control_enabled, shm_lane_enabled
from shoal.learner.overlap import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    GradientBucketer,
)
from shoal.learner.shard_session import ShardSession
from shoal.v1 import job_pb2, parameter_sync_service_pb2 as ps_pb2

__all__ = ["BACKEND_NAME", "CHECKPOINT_FILE", "CollectiveBackend", "CollectiveError"]

log = logging.getLogger("shoal.learner.collective")
T = TypeVar("T")

BACKEND_NAME = "collective"
DEFAULT_TIMEOUT_S = 30.0


@dataclass
class _Pending:
    """The all-reduced update of iteration ``step``, applied once the iteration commits."""

    step: int
    grads: list[torch.Tensor | None]
    buffers: list[torch.Tensor]
    lr: float | None
    skip_step: bool = False  # the global gradient was not finite (float16 loss scaling)
    applied: bool = False  # applied ahead of the commit (the backend's StateCopy has before)


@dataclass
class _Ahead:
    """The vote of an iteration sent ahead (:meth:`CollectiveBackend.vote_ahead`): its
    request, where its answer comes, and the next iteration as that answer gives it if
    nothing changes (handed to the trainer before the answer)."""

    request: ps_pb2.BoundaryRequest
    md: Any
    direct: DirectControl | None  # the control-only lane's connection it went on, or
    call: concurrent.futures.Future[ps_pb2.BoundaryResponse] | None  # the loop's gRPC call
    next: Assignment
    handed: bool = False  # next_assignment() gave ``next``


class CollectiveBackend(SyncBackend):
    """A learner of a job in collective mode (see the module docstring).

    The connection to the job's coordinator is a :class:`ShardSession` (``session_args`` are
    its arguments: ``job_id``, ``learner_id``, ``coordinator``, ``token``, ``tls``, ...).
    ``timeout_s`` bounds every collective and the rendezvous; ``bucket_bytes`` is the size of
    the gradient buckets all-reduced concurrently (the first one ``first_bucket_bytes``, as
    DDP). ``overlap`` (default: ``SHOAL_COLLECTIVE_OVERLAP``, on) sends the buckets while
    backward runs (:mod:`shoal.learner.overlap`); off, they leave after it. Both issue the
    same collectives, so members may differ in it. ``lane_control`` (default: on unless
    ``SHOAL_LANE_CONTROL`` or ``SHOAL_SHM_LANE`` is off): on the host of the coordinator's
    shard, the Boundaries go on the control connection of a lane with no tensors to it
    instead of gRPC (docs/data-plane.md, "The lane's control channel"). ``ahead`` (default:
    ``SHOAL_COLLECTIVE_AHEAD``, on): with the trainer's leave (:meth:`vote_ahead`), an
    iteration's update is applied once its vote is sent (on that connection, else over gRPC
    from the loop), and the next iteration runs while the answer travels
    (``collective_ahead.py``).
    """

    #: The mode this backend joins a job in (the first Join fixes the job's).
    SYNC_MODE: int = job_pb2.SYNC_MODE_COLLECTIVE

    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        overlap: bool | None = None,
        lane_control: bool | None = None,
        ahead: bool | None = None,
        **session_args: Any,
    ) -> None:
        if timeout_s is None:
            raw = os.environ.get(environment.COLLECTIVE_TIMEOUT_S, str(DEFAULT_TIMEOUT_S))
            try:
                timeout_s = float(raw)
            except ValueError:
                raise ValueError(f"SHOAL_COLLECTIVE_TIMEOUT_S ({raw!r}) is not a number") from None
        if not timeout_s > 0:
            raise ValueError(f"timeout_s ({timeout_s!r}) must be > 0")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes ({bucket_bytes!r}) must be >= 1")
        if first_bucket_bytes < 1:
            raise ValueError(f"first_bucket_bytes ({first_bucket_bytes!r}) must be >= 1")
        if overlap is None:
            overlap = switch(environment.COLLECTIVE_OVERLAP, "on")
        self.session = ShardSession(what="collective backend", **session_args)
        # On the coordinator's host, the Boundaries go on a lane's control connection instead
        # of gRPC (ShardSession.open_coordinator_control; SHOAL_LANE_CONTROL, SHOAL_SHM_LANE).
        self.lane_control = (
            lane_control_enabled() and shm_lane_enabled() if lane_control is None else lane_control
        )
        self.job_id = self.session.job_id
        self.learner_id = self.session.learner_id
        self.timeout_s = timeout_s
        # The process group of the generation last formed (collective_group.py).
        self._group = CollectiveGroup(datetime.timedelta(seconds=timeout_s), torch.device("cpu"))
        self._bucket_bytes = bucket_bytes
        self._first_bucket_bytes = first_bucket_bytes
        self.overlap = overlap
        self.ahead = switch(environment.COLLECTIVE_AHEAD, "on") if ahead is None else ahead
        self._ahead_allowed = False  # the trainer's leave (vote_ahead)
        self._ahead: _Ahead | None = None  # the vote in flight
        self._copy: StateCopy | None = None  # the state before the update applied ahead
        self._state_bytes: int | None = None  # what _copy copies (known after a step)
        #: Iterations whose update was applied ahead, and of them taken back.
        self.applied_ahead = [0, 0]
        self._bucketer: GradientBucketer | None = None
        # Gradient buckets sent by the hooks while backward ran, and in all (overlap only).
        self.buckets_sent = [0, 0]
        self._params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._state_step = -1  # the iterations whose updates the state holds (-1: none)
        self._pending: _Pending | None = None
        self._reply: ps_pb2.BoundaryResponse | None = None
        self.formations: list[tuple[int, int, float]] = []  # (generation, world, seconds)
        self._setup: TrainingSetup | None = None
        self._plan: TrainingPlan | None = None
        self._layout: list[TensorMeta] = []
        self._ride = False  # the counts ride on the last gradient bucket (initialize)
        self._report = (0, -1, 0.0, 0)  # generation, completed iteration, loss_sum, samples
        self._user: UserMetrics = (-1, {})  # trainer.log

    @classmethod
    def from_env(cls, env: LearnerEnv) -> CollectiveBackend:
        return cls(**session_options(env, "collective backend"))

    @property
    def backend_name(self) -> str:
        """``"gloo"`` or ``"nccl"``: the torch.distributed backend of the current group."""
        return self._group.backend_name

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.session.run(coro)

    def _md(self) -> tuple[tuple[str, str], ...]:
        return self.session.md()

    # -- initialize ---------------------------------------------------------------------------

    def initialize(self, setup: TrainingSetup) -> InitialState:
        if self._setup is not None:
            raise RuntimeError("initialize() was already called on this backend")
        self._setup = setup
        self._layout = layout_of(setup)
        self.session.rejoin = self._join
        # The model's own tensors: the optimizer steps them in place.
        self._params = [p.detach() for p in setup.params]
        self._buffers = list(setup.buffers)
        self._optimizer = setup.optimizer.create(self._params, [s.name for s in setup.param_specs])
        if self._params:
            self._group.device = self._params[0].device
        md = self._md()  # the trace context of the join span, when tracing
        reply = self._run(self._join(md))
        if not reply.rendezvous_address:
            raise RuntimeError(
                f"coordinator {self.session.coordinator} gave no rendezvous address for job "
                f"{self.job_id}: the job is not in collective mode"
            )
        self._group.rendezvous_at(reply.rendezvous_address, reply.rendezvous_prefix or self.job_id)
        self._plan = plan = adopted_plan(reply, setup.plan)
        # The iteration's counts ride on the last gradient bucket (one collective less).
        self._ride = counts_ride(
            self._params, plan.num_samples, self._bucket_bytes, self._first_bucket_bytes
        )
        if reply.initialize:
            log.info("initializing job %s (collective)", self.job_id)
            self._state_step = 0
            return InitialState(plan, self._params, self._buffers, 0)
        return InitialState(plan, None, None, self._run(self.session.completed(md)))

    # -- coordinator failover (docs/data-plane.md, "Coordinator failover in collective mode") --

    def _join_fields(self) -> dict[str, Any]:
        """What this learner holds, for a coordinator that took the job over: it decides from
        the re-joining learners whether the iteration they voted for was committed."""
        return {
            "collective_state": ps_pb2.CollectiveLearnerState(
                state_step=self._state_step,
                holds_pending=self._pending is not None,
                generation=self._group.generation,
                world_size=self._group.world,
            )
        }

    async def _join(self, md: Any = None) -> ps_pb2.JoinResponse:
        """Join (the session's re-Join too); after a coordinator move, rendezvous through the
        new coordinator's store from the next generation on (the group re-forms in place,
        keeping model and optimizer; a pending update is applied or dropped by the next
        answer's completed_iterations)."""
        assert self._setup is not None
        request = join_request(
            self.job_id,
            self.learner_id,
            self._layout,
            self._setup,
            self.SYNC_MODE,
            **self._join_fields(),
        )
        reply = await self.session.join(request, md)
        self.session.route(reply.shards, self._layout)
        moved = (reply.rendezvous_address, reply.rendezvous_prefix or self.job_id)
        group = self._group
        if (
            group.rendezvous
            and reply.rendezvous_address
            and moved != (group.rendezvous, group.prefix)
        ):
            log.warning(
                "rendezvous moved with the coordinator: %s -> %s (state after %d iterations%s)",
                group.rendezvous,
                reply.rendezvous_address,
                self._state_step,
                ", holding the update of the last one" if self._pending is not None else "",
            )
            group.rendezvous_at(*moved)  # the old store is gone with its coordinator
        return reply

    # -- boundaries ---------------------------------------------------------------------------

    async def _exchange(
        self,
        *,
        generation: int = 0,
        completed: int = -1,
        loss_sum: float = 0.0,
        n: int = 0,
        failed: bool = False,
        md: Any = None,
        request: ps_pb2.BoundaryRequest | None = None,
        reply: ps_pb2.BoundaryResponse | None = None,
    ) -> ps_pb2.BoundaryResponse:
        """One Boundary (``request``, else built from the arguments), then any CHECKPOINT it
        asks for (written, reported), until the coordinator answers RUN, RETIRE or DONE.
        ``reply``: the answer the Boundary already got (on the trainer's thread)."""
        if request is None:
            request = self._boundary(generation, completed, loss_sum, n, failed)
        # Not a retry: each CHECKPOINT answer is a step of the protocol (control() retries).
        while True:
            if reply is None:
                reply = await self._boundary_call(request, md)
            if reply.action != ps_pb2.BOUNDARY_ACTION_CHECKPOINT:
                return reply
            report = await self.session.loop.run_in_executor(None, self._write_checkpoint, reply)
            request = boundary_request(
                self.job_id,
                self.learner_id,
                self._user,
                self._group.generation,
                checkpoint_file=report,
            )
            reply = None

    async def _boundary_call(
        self, request: ps_pb2.BoundaryRequest, md: Any
    ) -> ps_pb2.BoundaryResponse:
        """One Boundary through the loop (gRPC, or the lane's connection the loop holds),
        once the coordinator's control-only lane was asked for (for the Boundaries after)."""
        if self.lane_control:
            await self.session.open_coordinator_control(md)
        reply = await self.session.control("Boundary", request, md)
        self.session.answered_at(self.session.coordinator)
        return reply

    def _boundary(
        self, generation: int, completed: int, loss_sum: float, n: int, failed: bool
    ) -> ps_pb2.BoundaryRequest:
        return boundary_request(
            self.job_id,
            self.learner_id,
            self._user,
            generation,
            completed,
            loss_sum,
            n,
            iteration_failed=failed,
        )

    def _vote(self, request: ps_pb2.BoundaryRequest, md: Any) -> ps_pb2.BoundaryResponse:
        """The Boundary that ends an iteration: on the trainer's thread over the
        control-only lane when one is open (``ShardSession.boundary_direct``), else, and for
        whatever follows a CHECKPOINT answer, through the loop (:meth:`_exchange`)."""
        reply = self.session.boundary_direct(request, md) if self.lane_control else None
        if reply is not None and reply.action != ps_pb2.BOUNDARY_ACTION_CHECKPOINT:
            return reply
        return self._run(self._exchange(md=md, request=request, reply=reply))

    # -- the vote ahead (collective_ahead.py) --------------------------------------------------

    def vote_ahead(self, allowed: bool) -> None:
        self._ahead_allowed = allowed

    def _send_ahead(self, a: Assignment, request: ps_pb2.BoundaryRequest, md: Any) -> bool:
        """Vote ahead: send the vote of iteration ``a`` (on the control-only lane, from this
        thread; else as the loop's gRPC call, not awaited), apply its update at once (a copy
        of the state kept to take it back) and leave the answer to the next :meth:`sync`,
        which reads it before its all-reduce. Only with the trainer's leave, when the next
        iteration is in this epoch (the trainer reads the model at an epoch's end:
        evaluation, callbacks; checkpoints fall there) and when the state is small enough to
        copy every iteration (``AHEAD_MAX_BYTES``)."""
        plan = self._plan
        if (
            not (self.ahead and self._ahead_allowed)
            or plan is None
            or plan.is_last_of_epoch(a.iteration)
            or not self._ahead_fits()
        ):
            return False
        direct = self.session.send_boundary(request, md) if self.lane_control else None
        call = None if direct is not None else self.session.start(self._boundary_call(request, md))
        start, stop = plan.batch_range(a.iteration + 1)
        following = dataclasses.replace(
            a,
            iteration=a.iteration + 1,
            step=a.step + 1,
            batch_start=start,
            batch_stop=stop,
            pull_parameters=False,
        )
        self._ahead = _Ahead(request, md, direct, call, following)
        p = self._pending
        assert p is not None and self._optimizer is not None
        if self._copy is None:
            self._copy = StateCopy(self._params, self._buffers, self._optimizer)
        self._copy.take()
        self._apply(p)
        p.applied = True
        self.applied_ahead[0] += 1
        return True

    def _ahead_fits(self) -> bool:
        size = self._state_bytes
        if size is None:
            assert self._optimizer is not None
            size = state_bytes(self._params, self._buffers, self._optimizer)
            if self._optimizer.state:  # (it exists after the first step: the size is settled)
                self._state_bytes = size
        return size <= AHEAD_MAX_BYTES.get(self._group.device.type, 0)

    def _answer_ahead(self, expected: Assignment | None) -> bool:
        """Read the answer to the vote sent ahead. True when it commits that iteration and
        runs ``expected`` (the iteration given ahead) next. Otherwise the iteration given
        ahead does not hold: its forward's changes to the buffers are undone, whatever the
        answer asks first is done (a CHECKPOINT: written), the update is kept or taken back
        by what it says, and the answer is kept for :meth:`next_assignment`; False."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        if ahead.direct is not None:
            reply = self.session.boundary_answer(ahead.direct)
        else:
            assert ahead.call is not None
            try:
                reply = ahead.call.result()
            except Exception as exc:  # asked again below: an error that holds is raised there
                log.info("the vote sent ahead got no answer (%s): asking again", first_line(exc))
                reply = None
        if (
            expected is not None
            and reply is not None
            and reply.action == ps_pb2.BOUNDARY_ACTION_RUN
            and reply.completed_iterations == expected.step
            and assignment_of(reply, self._require_plan(), self._report[:2]) == expected
        ):
            self._settle(reply.completed_iterations, final=True)
            return True
        p = self._pending
        if p is not None and p.applied:
            self._load_buffers(p)
        if self._bucketer is not None:
            self._bucketer.discard()  # launched during the iteration given ahead
        if reply is None or reply.action == ps_pb2.BOUNDARY_ACTION_CHECKPOINT:
            reply = self._run(self._exchange(md=ahead.md, request=ahead.request, reply=reply))
        self._settle(reply.completed_iterations, final=True)
        self._reply = reply
        return False

    def log_metrics(self, step: int, metrics: Mapping[str, tuple[float, int]]) -> None:
        self._user = (step, dict(metrics))

    def next_assignment(self) -> Assignment | None:
        plan = self._require_plan()
        # Not a retry: a generation that did not form is reported, and the coordinator's
        # answer (a new generation, or the end) is the next turn.
        while True:
            if self._ahead is not None and self._reply is None:
                if not self._ahead.handed:
                    self._ahead.handed = True
                    return self._ahead.next  # before the answer: sync() reads it
                self._answer_ahead(None)  # the iteration given ahead was not synced
            reply = (
                self._reply if self._reply is not None else self._run(self._exchange(md=self._md()))
            )
            self._reply = None
            self._settle(reply.completed_iterations, final=True)
            assignment = assignment_of(reply, plan, self._report[:2])
            if assignment is None or assignment.retire:
                return assignment
            if assignment.generation == self._group.generation and self._group.pg is not None:
                return assignment
            try:
                self._form(assignment, reply.checkpoint_directory)
            except RuntimeError as exc:  # a member vanished during the rendezvous
                failure = first_line(exc)
            else:
                return assignment
            log.warning("generation %d did not form: %s", assignment.generation, failure)
            self._drop_group()
            self._reply = self._run(
                self._exchange(generation=assignment.generation, failed=True, md=self._md())
            )

    def _settle(self, completed: int, *, final: bool) -> None:
        """Apply the pending update if its iteration is among the ``completed`` ones; drop it
        when the answer is final and it is not (the iteration was aborted)."""
        p = self._pending
        if p is None:
            return
        if completed > p.step:
            if not p.applied:
                self._apply(p)
            self._state_step = p.step + 1
            self._pending = None
        elif final:
            if p.applied:
                self._take_back(p)
            log.info("iteration %d was aborted: its update is dropped", p.step)
            self._pending = None

    def _take_back(self, p: _Pending) -> None:
        """The state as it was before ``p``'s update, applied ahead (bitwise: a copy)."""
        assert self._copy is not None
        self._copy.restore()
        p.applied = False
        self.applied_ahead[1] += 1

    @torch.no_grad()
    def _apply(self, p: _Pending) -> None:
        optimizer = self._optimizer
        assert optimizer is not None
        if p.lr is not None:
            set_learning_rate(optimizer, p.lr)
        for param, grad in zip(self._params, p.grads, strict=True):
            param.grad = grad
        if not p.skip_step:
            optimizer.step()
        for param in self._params:
            param.grad = None
        self._load_buffers(p)

    @torch.no_grad()
    def _load_buffers(self, p: _Pending) -> None:
        """The reduced buffers of ``p`` into the model's (its update's part for them)."""
        for dst, src in zip(self._buffers, p.buffers, strict=True):
            dst.copy_(src)

    # -- the process group --------------------------------------------------------------------

    def _form(self, a: Assignment, restore_directory: str) -> None:
        """Tear down the old group, form generation ``a.generation``'s, and bring every
        member to the job's state (broadcast from a holder, or a checkpoint)."""
        self._drop_group()
        started = time.monotonic()
        self._group.form(a)
        self._sync_state(a, restore_directory)
        seconds = time.monotonic() - started
        self.formations.append((a.generation, a.world_size, seconds))
        log.info(
            "generation %d: %s group of %d formed in %.3f s (rank %d, step %d)",
            a.generation,
            self._group.backend_name,
            a.world_size,
            seconds,
            a.rank,
            a.step,
        )

    def _drop_group(self) -> None:
        """Destroy the group (``CollectiveGroup.drop``: peers blocked on this learner fail at
        once), after the buckets in flight, whose works hold it."""
        if self._bucketer is not None:
            self._bucketer.discard()  # a pending work holds the group: it must not outlive it
        self._group.drop()

    @torch.no_grad()
    def _sync_state(self, a: Assignment, restore_directory: str) -> None:
        steps = torch.full((a.world_size,), -1, dtype=torch.int64, device=self._group.comm_device())
        steps[a.rank] = self._state_step
        self._group.wait(self._group.allreduce([steps], dist.ReduceOp.MAX))
        holders = [r for r, s in enumerate(steps.tolist()) if s == a.step]
        if len(holders) == a.world_size:
            return  # everyone holds it already (a shrink, or an aborted iteration)
        if holders:
            src = holders[0]
        elif restore_directory:
            src = 0
            if a.rank == 0:
                self._load_checkpoint(restore_directory, a.step)
        elif a.step == 0:
            src = 0  # a restart from scratch: rank 0's freshly built model
        else:
            raise RuntimeError(
                f"no member of generation {a.generation} holds the state after {a.step} "
                "iterations and the coordinator named no checkpoint"
            )
        self._group.broadcast_tensors([*self._params, *self._buffers], src)
        assert self._optimizer is not None
        self._group.broadcast_optimizer(self._optimizer, src, a.rank)
        self._state_step = a.step

    # -- overlap (shoal.learner.overlap) -------------------------------------------------------

    def overlap_hooks(self, params: Sequence[torch.nn.Parameter]) -> GradientBucketer | None:
        """Hooks on the model's ``params`` (the trainer's, in spec order) that send the
        gradient buckets as backward produces them; None when overlap is off."""
        if not self.overlap:
            return None
        if len(params) != len(self._params) or not all(
            p.data_ptr() == q.data_ptr() and p.shape == q.shape
            for p, q in zip(params, self._params, strict=True)
        ):
            raise ValueError("params are not the model's parameters this backend was set up with")
        if self._bucketer is None:
            self._bucketer = GradientBucketer(
                params,
                self._launch_bucket,
                self._group.comm_device,
                bucket_bytes=self._bucket_bytes,
                first_bucket_bytes=self._first_bucket_bytes,
                needed=lambda: self._group.world > 1,  # (a group of one reduces nothing)
                tail=2 + len(params) if self._ride else 0,  # the counts: [n, loss sum, flags]
            )
        return self._bucketer

    def _launch_bucket(self, flat: torch.Tensor) -> Any:
        if self._group.pg is None:
            raise RuntimeError("no process group (it failed or is being re-formed)")
        return self._group.allreduce([flat])[0]

    # -- sync ---------------------------------------------------------------------------------

    def sync(
        self, assignment: Assignment, contribution: Contribution, *, lr: float | None = None
    ) -> SyncResult:
        setup = self._setup
        if setup is None:
            raise RuntimeError("initialize() must be called first")
        if len(contribution.grads) != len(self._params):
            raise ValueError(
                f"contribution has {len(contribution.grads)} gradients, "
                f"expected {len(self._params)}"
            )
        if self._group.pg is None or assignment.generation != self._group.generation:
            raise RuntimeError(
                f"assignment of generation {assignment.generation} without its group "
                f"(formed: {self._group.generation}); call next_assignment() first"
            )
        if self._ahead is not None:
            p = self._pending
            if not self._answer_ahead(assignment):
                taken_back = p.step if p is not None and self._state_step == p.step else None
                raise IterationAborted(
                    f"iteration {assignment.step} ran ahead of the answer to the vote before "
                    "it, which said otherwise"
                    + (f" (iteration {taken_back} was aborted)" if taken_back is not None else ""),
                    ahead=True,
                    taken_back=taken_back,
                )
        launched = None
        bucketer = self._bucketer
        if bucketer is not None and bucketer.finished:
            # The trainer's backward already sent the buckets (on this generation's group:
            # groups change only in next_assignment, which drops what is in flight).
            self.buckets_sent[0] += bucketer.launched_in_backward
            launched = bucketer.take()
            self.buckets_sent[1] += len(launched.buckets)
            if launched.n != contribution.n_samples:
                raise ValueError(
                    f"contribution has {contribution.n_samples} samples, its gradient buckets "
                    f"were sent for {launched.n}"
                )
        try:
            grads, buffers, total, loss_sum = reduce_contribution(
                self._group,
                self._params,
                contribution,
                launched,
                self._bucket_bytes,
                self._first_bucket_bytes,
                self._ride,
            )
        except CollectiveError as exc:
            failure: str | None = str(exc)
        else:
            failure = None
        if failure is not None:
            log.warning(
                "all-reduce of iteration %d (generation %d) failed: %s",
                assignment.step,
                assignment.generation,
                failure,
            )
            self._drop_group()  # the peers still blocked on this learner fail at once
            self._reply = self._run(
                self._exchange(generation=assignment.generation, failed=True, md=self._md())
            )
            raise IterationAborted(f"collective failed: {failure}")
        # Every member holds the same reduced gradient: clipping it here is clipping the
        # global gradient, and every member decides the same about a non-finite one.
        grad_norm, skip_step = apply_gradient_policy(grads, setup)
        if faults.armed(faults.STOP_BEFORE_VOTE, assignment.step):
            faults.stop(faults.STOP_BEFORE_VOTE)  # all-reduced, not voted (test fault point)
        self._pending = _Pending(assignment.step, grads, buffers, lr, skip_step)
        self._report = (
            assignment.generation,
            assignment.step,
            contribution.loss_sum,
            contribution.n_samples,
        )
        md = self._md()
        request = self._boundary(
            assignment.generation,
            assignment.step,
            contribution.loss_sum,
            contribution.n_samples,
            False,
        )
        if not self._send_ahead(assignment, request, md):
            reply = self._vote(request, md)
            self._settle(reply.completed_iterations, final=True)
            self._reply = reply
            if self._state_step != assignment.step + 1:
                raise IterationAborted(
                    f"iteration {assignment.step} was aborted by the coordinator (a member failed)"
                )
        return SyncResult(
            self._params, self._buffers, assignment.step, loss_sum / total, grad_norm, skip_step
        )

    def pull_parameters(self) -> ModelState:
        """The job's state, which the group formation brought into this learner's own
        tensors (they are the model's: nothing is copied)."""
        if self._setup is None:
            raise RuntimeError("initialize() must be called first")
        if self._state_step < 0:
            raise RuntimeError("this learner holds no state yet: next_assignment() forms it")
        return ModelState(self._params, self._buffers)

    # -- checkpoints (the format: shoal.learner.collective_checkpoint) ------------------------

    def _write_checkpoint(self, reply: ps_pb2.BoundaryResponse) -> ps_pb2.CheckpointFile:
        """Write this learner's state after ``reply.completed_iterations`` iterations as the
        parameter-sync shard file of index 0 (holding every tensor) in the directory given."""
        self._settle(reply.completed_iterations, final=False)
        p = self._pending
        if p is not None and p.applied:  # the checkpoint is of the state before it
            self._take_back(p)
        iteration = int(reply.completed_iterations)
        if self._state_step != iteration:
            raise RuntimeError(
                f"asked to checkpoint iteration {iteration} but this learner holds "
                f"{self._state_step}"
            )
        setup, optimizer = self._setup, self._optimizer
        assert setup is not None and optimizer is not None
        data = encode_checkpoint(
            setup, self._params, self._buffers, optimizer, job_id=self.job_id, iteration=iteration
        )
        written = write_checkpoint_file(reply.checkpoint_directory, data, iteration)
        if written.error:
            log.error(
                "checkpoint after %d iterations not written to %s: %s",
                iteration,
                reply.checkpoint_directory,
                written.error,
            )
        else:
            log.info(
                "checkpoint after %d iterations written to %s",
                iteration,
                reply.checkpoint_directory,
            )
        return written

    @torch.no_grad()
    def _load_checkpoint(self, directory: str, step: int) -> None:
        """Load the state from a checkpoint of either mode (its manifest lists the files)."""
        setup, optimizer = self._setup, self._optimizer
        assert setup is not None and optimizer is not None
        load_checkpoint(directory, step, setup, self._params, self._buffers, optimizer)
        self._state_step = step
        log.info("state restored from checkpoint %s (%d iterations)", directory, step)

    # -- the rest -----------------------------------------------------------------------------

    def report_epoch(self, report: EpochReport) -> None:
        values = {"test_loss": float(report.loss)}
        values.update({k: float(v) for k, v in report.metrics.items()})
        self.session.report_epoch_metrics(report.epoch, values)

    def close(self) -> None:
        self._ahead = None
        self._drop_group()
        if self._bucketer is not None:
            self._bucketer.remove()
        self._group.forget_store()
        self.session.close()

    def _require_plan(self) -> TrainingPlan:
        if self._plan is None:
            raise RuntimeError("initialize() must be called first")
        return self._plan


if BACKEND_NAME not in registered_backends():  # also an entry point of the package
    register_backend(BACKEND_NAME, CollectiveBackend.from_env)
