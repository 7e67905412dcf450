"""Gradient buckets that leave while backward still runs: DistributedDataParallel's reducer,
made for shoal's collective mode (docs/data-plane.md, "Overlap of the all-reduce with
backward").

:func:`bucket_layout` cuts a model's parameters, in **reverse** order (the order backward
produces their gradients), into buckets of one dtype: the first at most
``first_bucket_bytes`` (1 MiB, as DDP, so communication starts early), the others at most
``bucket_bytes`` (25 MiB); a larger tensor is a bucket of its own. Every member of a group
computes the same layout from the same model, and launches the buckets in the same order, so
the collectives always match across ranks whether a member overlaps or not.

:class:`GradientBucketer` registers ``Tensor.register_post_accumulate_grad_hook`` on every
parameter. :func:`shoal.learner.steps.compute_contribution` drives it: :meth:`begin` at the
start of the share, :meth:`arm` just before the **last** micro-batch's backward (the gradient
is final only then: earlier micro-batches only accumulate), :meth:`finish` after it. While
armed, each hook copies its parameter's gradient into its bucket's flat tensor; when every
parameter of a bucket that requires a gradient has been copied, the bucket is scaled
(``inv_scale`` of float16 loss scaling, then the sample count ``n``: the exact operations of
the path without overlap) and handed to ``launch`` (an async all-reduce), strictly in bucket
order. :meth:`finish` flushes what backward did not produce: a parameter unused by the last
micro-batch contributes the gradient the earlier ones accumulated, a parameter with no
gradient at all contributes zeros (the all-reduced flags decide whether it gets one), and the
remaining buckets are launched. A bucket holding an unused parameter waits for
:meth:`finish`, and so do the buckets after it (order is what keeps ranks matched), so such a
model overlaps less, never wrongly.

The owner (``CollectiveBackend``) takes the launched buckets with :meth:`take`, waits for
them with the rest of the iteration's collectives, and drops them with :meth:`discard` when
its group goes (a failed or re-formed group must not keep a pending work).

With ``tail`` the **last** bucket's flat tensor has room for that many more elements after its
gradients, and that bucket is held: the hooks and :meth:`finish` fill and scale it but do not
launch it; :meth:`take` hands it over, and the owner writes the iteration's counts into the
tail and launches it (the counts ride on the last bucket instead of a collective of their own:
``collective_group.reduce_contribution``). The last bucket holds the first layers' gradients,
the last that backward produces, so holding it costs next to no overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch._utils import _unflatten_dense_tensors

__all__ = [
    "COUNT_DTYPES",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "GradientBucketer",
    "GradientHooks",
    "LaunchedBuckets",
    "bucket_layout",
    "without_graph",
]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's bucket_cap_mb
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket (torch.distributed's default)

#: The dtypes of a bucket the iteration's counts may ride on: integers up to 2**24 are exact
#: in them (a sample count, the flags summed over the members).
COUNT_DTYPES = (torch.float32, torch.float64)


def without_graph(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` with grad mode off, for a gradient hook's copies: a usual backward runs
    its hooks without grad mode already (nothing to enter: ``torch.no_grad()`` costs ~2 us
    per call, and a hook runs once per parameter per iteration); one with ``create_graph``
    runs them with it, and the copy must not join the graph."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            fn(*args)
    else:
        fn(*args)


class GradientHooks(Protocol):
    """What :func:`shoal.learner.steps.compute_contribution` calls around backward."""

    def begin(self) -> None: ...

    def arm(self, n: int, inv_scale: torch.Tensor | None) -> None: ...

    def finish(self) -> None: ...

    def remove(self) -> None: ...


def bucket_layout(
    tensors: Sequence[torch.Tensor],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Indices of ``tensors`` in buckets, in reverse order (see the module docstring)."""
    if bucket_bytes < 1 or first_bucket_bytes < 1:
        raise ValueError(
            f"bucket sizes ({first_bucket_bytes!r}, {bucket_bytes!r}) must be >= 1 byte"
        )
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    dtype: torch.dtype | None = None
    for j in reversed(range(len(tensors))):
        t = tensors[j]
        nbytes = t.numel() * t.element_size()
        limit = first_bucket_bytes if not buckets else bucket_bytes
        if current and (t.dtype != dtype or size + nbytes > limit):
            buckets.append(current)
            current, size = [], 0
        current.append(j)
        size += nbytes
        dtype = t.dtype
    if current:
        buckets.append(current)
    return buckets


@dataclass
class _Bucket:
    indices: list[int]
    numel: int
    dtype: torch.dtype
    expected: int  # parameters of the bucket that require a gradient
    pending: int = 0
    written: list[bool] = field(default_factory=list)
    flat: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)  # of flat, one per slot


@dataclass
class LaunchedBuckets:
    """One iteration's buckets: ``(indices, flat)`` each (the flat tensor is the
    concatenation of the parameters ``indices``, in that order, times ``n``), the works
    launched on them, the sample count they were scaled by, and the first launch failure.
    ``held``: the last bucket was not launched (its flat has the tail after the gradients)."""

    buckets: list[tuple[list[int], torch.Tensor]]
    works: list[Any]
    n: int
    failure: str | None
    held: bool = False


class GradientBucketer:
    """See the module docstring. ``launch(flat)`` starts the all-reduce of one bucket and
    returns its work (it may raise: the failure is kept and reported by :meth:`take`);
    ``device()`` is where the flat tensors live (the group's communication device).
    ``needed()`` (default: always) says at :meth:`begin` whether the share's buckets are sent
    from the hooks at all: not in a group of one, where there is nothing to overlap (the
    hooks' copies would only cost); the share's gradients then leave in ``sync``, as with
    overlap off (:attr:`finished` stays false)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        launch: Callable[[torch.Tensor], Any],
        device: Callable[[], torch.device],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        needed: Callable[[], bool] | None = None,
        tail: int = 0,
    ) -> None:
        self._params = list(params)
        self.tail = tail
        self._needed = needed
        self._idle = False  # this share's hooks send nothing (needed() said so at begin)
        self._launch_fn = launch
        self._device = device
        self.layout = bucket_layout(self._params, bucket_bytes, first_bucket_bytes)
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # parameter -> (bucket, slot)
        for b, indices in enumerate(self.layout):
            for slot, j in enumerate(indices):
                self._where[j] = (b, slot)
            numel = sum(self._params[j].numel() for j in indices)
            self._buckets.append(_Bucket(indices, numel, self._params[indices[0]].dtype, 0))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook_for(j))
            for j, p in enumerate(self._params)
            if p.requires_grad
        ]
        self._armed = False
        self._active = False  # between begin() and take()/discard()
        self._finished = False
        self._n: int | None = None
        self._inv_scale: torch.Tensor | None = None
        self._next = 0
        self._works: list[Any] = []
        self._failure: str | None = None
        self.launched_in_backward = 0  # buckets launched by hooks (not by finish) last time

    # -- the iteration ------------------------------------------------------------------------

    def begin(self) -> None:
        """Start a share: forget anything not taken (its works are dropped, not waited)."""
        self.discard()
        self._idle = self._needed is not None and not self._needed()
        if self._idle:
            return
        self._active = True
        self.launched_in_backward = 0
        for bucket in self._buckets:
            bucket.expected = sum(1 for j in bucket.indices if self._params[j].requires_grad)
            bucket.pending = bucket.expected
            bucket.written = [False] * len(bucket.indices)
            bucket.flat = None
            bucket.views = []

    def arm(self, n: int, inv_scale: torch.Tensor | None) -> None:
        """The next backward is the share's last: its hooks send the buckets, scaled by
        ``inv_scale`` (when not None) and then by ``n``."""
        if self._idle:
            return
        if not self._active:
            raise RuntimeError("arm() before begin()")
        self._armed = True
        self._n = n
        self._inv_scale = inv_scale

    def finish(self) -> None:
        """The share's backward is over: launch every bucket not launched yet, in order."""
        if self._idle:
            return
        if not self._active:
            raise RuntimeError("finish() before begin()")
        self._armed = False
        for bucket in self._buckets[self._next :]:
            bucket.pending = 0
        self._launch_ready()
        self._finished = True

    @property
    def finished(self) -> bool:
        """Whether this share's buckets were all launched and not taken yet."""
        return self._active and self._finished

    def take(self) -> LaunchedBuckets:
        """The launched buckets, handed over (the bucketer keeps no reference to them)."""
        if not self.finished:
            raise RuntimeError("take() before finish()")
        n = self._n if self._n is not None else 0
        launched = LaunchedBuckets(
            [(b.indices, b.flat) for b in self._buckets if b.flat is not None],
            self._works,
            n,
            self._failure,
            held=self.tail > 0,
        )
        self._reset()
        return launched

    def discard(self) -> None:
        """Drop the iteration in flight (its works included): the group is going away."""
        self._reset()

    def remove(self) -> None:
        """Remove the hooks from the parameters (the model outlives the backend)."""
        self.discard()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- internals ----------------------------------------------------------------------------

    def _reset(self) -> None:
        self._active = self._armed = self._finished = False
        self._works = []
        self._failure = None
        self._n = None
        self._inv_scale = None
        self._next = 0
        for bucket in self._buckets:
            bucket.flat = None
            bucket.views = []

    def _hook_for(self, j: int) -> Callable[[torch.Tensor], None]:
        b, slot = self._where[j]

        def hook(param: torch.Tensor) -> None:
            if self._armed:
                without_graph(self._ready, b, slot, param)

        return hook

    def _ready(self, b: int, slot: int, param: torch.Tensor) -> None:
        """One parameter's gradient is final: into its bucket's slot; the bucket goes when it
        is full and every bucket before it went. Called once per parameter per backward:
        plain Python and one copy (a hook per parameter is the per-iteration cost that grows
        with the model's tensor count)."""
        if b < self._next:
            return  # already launched (a second backward in the armed window): not resent
        bucket = self._buckets[b]
        grad = param.grad
        if grad is not None:
            self._slot(bucket, slot).copy_(grad)
            if not bucket.written[slot]:
                bucket.written[slot] = True
                bucket.pending -= 1
        if bucket.pending <= 0 and b == self._next:
            self.launched_in_backward += self._launch_ready()

    def _slot(self, bucket: _Bucket, slot: int) -> torch.Tensor:
        """The view of ``bucket``'s flat tensor for its parameter ``slot`` (the flat tensor and
        all its views made at the bucket's first use in a share)."""
        if bucket.flat is None:
            room = self.tail if bucket is self._buckets[-1] else 0
            flat = torch.empty(bucket.numel + room, dtype=bucket.dtype, device=self._device())
            bucket.flat = flat
            # One C++ call for all the views (a narrow and a view from Python: ~4 us each).
            bucket.views = list(
                _unflatten_dense_tensors(flat, [self._params[j] for j in bucket.indices])
            )
        return bucket.views[slot]

    @torch.no_grad()
    def _launch_ready(self) -> int:
        launched = 0
        while self._next < len(self._buckets) and self._buckets[self._next].pending <= 0:
            launched += self._launch(self._buckets[self._next])
            self._next += 1
        return launched

    def _launch(self, bucket: _Bucket) -> bool:
        """Fill and scale ``bucket``, and launch it unless it is held; whether it went."""
        if self._n is None:  # never armed: an empty share contributes zeros
            for slot in range(len(bucket.indices)):
                self._slot(bucket, slot).zero_()
        else:
            for slot, j in enumerate(bucket.indices):
                if not bucket.written[slot]:
                    grad = self._params[j].grad
                    target = self._slot(bucket, slot)
                    if grad is None:
                        target.zero_()
                    else:  # accumulated by earlier micro-batches, untouched by the last one
                        target.copy_(grad)
            assert bucket.flat is not None
            grads = bucket.flat.narrow(0, 0, bucket.numel)  # (not the tail)
            if self._inv_scale is not None:
                # On the bucket's device: a gloo group of CUDA learners buckets on the CPU.
                grads.mul_(self._inv_scale.to(bucket.flat.device, bucket.flat.dtype))
            grads.mul_(self._n)
        if self.tail and bucket is self._buckets[-1]:
            return False  # held: the owner writes the tail and launches it
        if self._failure is not None:
            return True  # the group already failed: nothing more is sent on it
        try:
            self._works.append(self._launch_fn(bucket.flat))
        except RuntimeError as exc:  # a broken group; reported by take(), never in backward
            text = str(exc)
            self._failure = text.splitlines()[0] if text else type(exc).__name__
        return True
