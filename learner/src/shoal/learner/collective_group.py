"""The torch.distributed process group of a collective-mode learner (``collective.py``): one
:class:`CollectiveGroup` per learner, re-formed in place for each generation.

It owns the rendezvous client (the coordinator-hosted TCPStore, under the job's secret prefix
and ``g<generation>/``), the formation (NCCL when every member has a CUDA device, gloo
otherwise, on this machine's address on the route to the rendezvous host), the collectives
with their explicit timeout, and the broadcasts that bring joiners to the job's state. It
holds no training state: the backend decides what to reduce, what to broadcast and when to
re-form (docs/data-plane.md, "Collective mode").
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shoal.learner.overlap import COUNT_DTYPES, LaunchedBuckets, bucket_layout
from shoal.learner.sync_types import Assignment, Contribution

__all__ = ["CollectiveError", "CollectiveGroup", "reduce_contribution"]

log = logging.getLogger("shoal.learner.collective")


class CollectiveError(RuntimeError):
    """A collective of the current group failed (a peer died, or the timeout passed)."""


class _Done:
    """The work of a collective that had nothing to do (a group of one)."""

    @staticmethod
    def wait() -> bool:
        return True


_DONE = _Done()


class CollectiveGroup:
    """The group of the generation last formed (see the module docstring). ``timeout`` bounds
    every collective and the rendezvous; ``device`` is where this learner's model lives."""

    def __init__(self, timeout: datetime.timedelta, device: torch.device) -> None:
        self.timeout = timeout
        self.device = device
        # The rendezvous: the store's address and the job's key prefix in it (JoinResponse).
        self.rendezvous = ""
        self.prefix = ""
        self._store: Any = None
        self.pg: Any = None
        self.generation = 0  # of the group last formed
        self.world = 0
        self.backend_name = ""  # "gloo" or "nccl" of the current group

    def rendezvous_at(self, address: str, prefix: str) -> None:
        """Rendezvous at ``address`` under ``prefix`` from the next formation on (a store of
        another address is a new client: the old store went with its coordinator)."""
        if (address, prefix) != (self.rendezvous, self.prefix):
            self.rendezvous, self.prefix = address, prefix
            self._store = None

    def forget_store(self) -> None:
        self._store = None

    # -- formation ----------------------------------------------------------------------------

    def _local_host(self, host: str, port: int) -> str:
        """This machine's address on the route to the rendezvous host (for gloo's sockets)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((host, port))
                return str(s.getsockname()[0])
            except OSError:
                return "127.0.0.1"

    def _store_client(self) -> Any:
        if self._store is None:
            host, _, port = self.rendezvous.rpartition(":")
            self._store = dist.TCPStore(
                host, int(port), is_master=False, timeout=self.timeout, use_libuv=True
            )
        return self._store

    def form(self, a: Assignment) -> None:
        """Form generation ``a.generation``'s group (the old one must be dropped first)."""
        store = dist.PrefixStore(f"{self.prefix}/g{a.generation}/", self._store_client())
        store.set(f"device/{a.rank}", self.device.type)
        kinds = {store.get(f"device/{r}").decode() for r in range(a.world_size)}
        use_nccl = kinds == {"cuda"} and dist.is_nccl_available()
        # No local variable keeps the group: a failure's traceback must not keep it alive
        # (gloo closes its sockets, which is how the peers learn, only when it is destroyed).
        if use_nccl:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, a.rank, a.world_size, options)
            self.backend_name = "nccl"
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            interface = os.environ.get("GLOO_SOCKET_IFNAME")
            if interface:
                device = dist.ProcessGroupGloo.create_device(interface=interface)
            else:
                host, _, port = self.rendezvous.rpartition(":")
                device = dist.ProcessGroupGloo.create_device(
                    hostname=self._local_host(host, int(port))
                )
            options._devices = [device]
            self.pg = dist.ProcessGroupGloo(store, a.rank, a.world_size, options)
            self.backend_name = "gloo"
        self.generation, self.world = a.generation, a.world_size

    def drop(self) -> None:
        """Destroy the group. For gloo that closes its sockets, so peers blocked on this
        learner fail at once instead of at their timeout; NCCL is aborted first (a kernel may
        still wait on the device). Pending works hold the group: the caller drops them
        first."""
        pg, self.pg = self.pg, None
        if pg is not None and self.backend_name == "nccl":
            try:
                pg.abort()
            except Exception as exc:  # a broken communicator may refuse; it is dropped anyway
                log.debug("aborting generation %d: %s", self.generation, exc)
        del pg  # the last reference (see wait)

    # -- collectives --------------------------------------------------------------------------

    def comm_device(self) -> torch.device:
        return self.device if self.backend_name == "nccl" else torch.device("cpu")

    def allreduce(self, tensors: Sequence[torch.Tensor], op: Any = None) -> list[Any]:
        """Start a sum (or ``op``) of each of ``tensors`` over the group, in place; their works.
        In a group of one the sum or maximum over its members is the tensor as it is: nothing
        is started (the same bytes; gloo's copy and its work cost ~0.25 ms an iteration)."""
        if self.world == 1 and self.pg is not None:
            return [_DONE] * len(tensors)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op is None else op
        opts.timeout = self.timeout
        return [self.pg.allreduce([t], opts) for t in tensors]

    @staticmethod
    def wait(works: list[Any]) -> None:
        """Wait for every pending collective. On failure the works (which hold the group)
        are released before the error propagates, so that dropping the group destroys it."""
        try:
            for w in works:
                w.wait()
        except RuntimeError as exc:
            message = first_line(exc)
        else:
            return
        finally:
            works.clear()
        raise CollectiveError(message)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        self.wait([self.pg.broadcast([t], opts) for t in tensors])

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """``tensors`` of rank ``src`` into every member's (in place), one flat per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors([t.to(self.comm_device()) for t in group])
            self.broadcast([flat], src)
            for dst, src_t in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                dst.copy_(src_t)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, src: int, rank: int) -> None:
        """Rank ``src``'s optimizer state into every member's ``optimizer``."""
        device = self.comm_device()
        if rank == src:
            buffer = io.BytesIO()
            torch.save(_to_cpu(optimizer.state_dict()), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        self.broadcast([size], src)
        data = (
            payload.to(device)
            if rank == src
            else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        )
        self.broadcast([data], src)
        if rank != src:
            state = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
            optimizer.load_state_dict(state)


@torch.no_grad()
def reduce_contribution(
    group: CollectiveGroup,
    params: Sequence[torch.Tensor],
    contribution: Contribution,
    launched: LaunchedBuckets | None,
    bucket_bytes: int,
    first_bucket_bytes: int,
    ride: bool = False,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor], float, float]:
    """All-reduce ``n * grad`` (in buckets of :func:`~shoal.learner.overlap.bucket_layout`,
    already launched during backward when ``launched`` is given), ``n``, the loss sum,
    which parameters got a gradient, ``n * buffer`` (float buffers) and the buffers'
    maximum (integer ones), as :func:`~shoal.learner.backend.reduce_contributions` weighs
    them. Both paths issue the same collectives in the same order.

    ``ride`` (:func:`counts_ride`, the same on every member): the counts ``[n, loss sum,
    flags]`` ride in the tail of the last bucket (in its dtype) instead of a float64
    collective of their own: one collective less per iteration (the loss sum is then summed
    in the bucket's precision; the counts stay exact).

    In a group of one (the bucketer idle: ``launched`` is None) the sums over the one member
    are its own values: its gradients and buffers as they are (the buffers copied: the next
    forward changes the model's), with no weighting by ``n`` and back (``n * g / n`` may differ
    from ``g`` in the last bit; ``g`` is the single process's gradient)."""
    n = contribution.n_samples
    if group.world == 1 and launched is None:
        if n <= 0:
            raise RuntimeError("no member of the iteration had a sample")
        return (
            [None if g is None else g.detach() for g in contribution.grads],
            [b.detach().clone() for b in contribution.buffers],
            float(n),
            float(contribution.loss_sum),
        )
    device = group.comm_device()
    # Built on the host in one operation (an element set per parameter costs a tensor op
    # each); pinned for a CUDA group, so that its copy does not wait for the device.
    meta = torch.tensor(
        [
            float(n),
            float(contribution.loss_sum),
            *(1.0 if g is not None and n > 0 else 0.0 for g in contribution.grads),
        ],
        dtype=torch.float64,
        pin_memory=device.type == "cuda",
    )
    works: list[Any] = []
    if launched is None:
        grads = [
            g.detach() if g is not None and n > 0 else torch.zeros_like(param)
            for param, g in zip(params, contribution.grads, strict=True)
        ]
        buckets = []
        layout = bucket_layout(grads, bucket_bytes, first_bucket_bytes)
        for b, indices in enumerate(layout):
            pieces = [grads[j].reshape(-1) for j in indices]
            room = len(meta) if ride and b == len(layout) - 1 else 0
            if room:  # (written below: the tail is not scaled)
                pieces.append(grads[indices[0]].new_empty(room))
            flat = torch.cat(pieces).to(device)
            flat.narrow(0, 0, flat.numel() - room).mul_(n)
            buckets.append((indices, flat))
        works += group.allreduce([flat for _, flat in (buckets[:-1] if ride else buckets)])
        held = ride
    else:
        buckets, works, held = launched.buckets, launched.works, launched.held
        if launched.failure is not None:
            works.clear()  # they hold the group, which the caller drops
            raise CollectiveError(launched.failure)
    if held:  # the counts ride in the last bucket's tail
        last = buckets[-1][1]
        counts = last.narrow(0, last.numel() - len(meta), len(meta))
        counts.copy_(meta)
        works += group.allreduce([last])
    else:
        counts = meta = meta.to(device, non_blocking=True)
        works += group.allreduce([meta])
    floats = [j for j, b in enumerate(contribution.buffers) if b.is_floating_point()]
    ints = [j for j, b in enumerate(contribution.buffers) if not b.is_floating_point()]
    flat_f = flat_i = None
    if floats:
        flat_f = _flatten_dense_tensors(
            [contribution.buffers[j].detach().to(device) for j in floats]
        ).mul_(n)
        works += group.allreduce([flat_f])
    if ints:
        flat_i = _flatten_dense_tensors([contribution.buffers[j].detach().to(device) for j in ints])
        if n == 0:
            flat_i.fill_(torch.iinfo(flat_i.dtype).min)
        works += group.allreduce([flat_i], dist.ReduceOp.MAX)
    group.wait(works)
    sums = counts.tolist()  # one copy back (the one sync), read as Python floats
    total = sums[0]
    if total <= 0:
        raise RuntimeError("no member of the iteration had a sample")
    reduced: list[torch.Tensor | None] = [None] * len(params)
    for indices, flat in buckets:
        size = sum(params[j].numel() for j in indices)
        flat.narrow(0, 0, size).div_(total)
        # The views in one C++ call (a narrow and a view each from Python: ~4 us a parameter).
        views = _unflatten_dense_tensors(flat, [params[j] for j in indices])
        for j, view in zip(indices, views, strict=True):
            if sums[2 + j] > 0:
                reduced[j] = view.to(params[j].device)
    # Every buffer is in one of the two fresh flat tensors: keep views of them.
    buffers = list(contribution.buffers)
    for indices, flat_b in ((floats, flat_f), (ints, flat_i)):
        if flat_b is None:
            continue
        if flat_b.is_floating_point():
            flat_b.div_(total)
        views = _unflatten_dense_tensors(flat_b, [buffers[j] for j in indices])
        for j, view in zip(indices, views, strict=True):
            buffers[j] = view
    return reduced, buffers, total, sums[1]


def counts_ride(params: Sequence[torch.Tensor], num_samples: int, *layout_args: int) -> bool:
    """Whether an iteration's counts may ride in the tail of its last gradient bucket
    (:func:`reduce_contribution`): that bucket's dtype keeps integers exact up to 2**24
    (``overlap.COUNT_DTYPES``) and no iteration can have more samples than that (the job's
    ``num_samples`` bounds every global batch). The same on every member (the same model
    and plan). ``layout_args``: the bucket sizes of :func:`~shoal.learner.overlap
    .bucket_layout`."""
    layout = bucket_layout(list(params), *layout_args)
    return bool(layout) and num_samples < 2**24 and params[layout[-1][0]].dtype in COUNT_DTYPES


def first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
