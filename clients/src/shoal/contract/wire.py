"""Tensor bundles on the wire: the codec of shoal's gradient and parameter streams.

A *bundle* is a list of tensors sent as one byte stream: a header message (a
``TensorBundleHeader`` giving each tensor's name, dtype, shape, byte ``offset`` and ``nbytes``
and the ``total_bytes``), then the raw little-endian bytes in chunks of 1-4 MiB. Every stream
of ``ParameterSyncService`` (``InitializeParameters``, ``SyncStep`` both ways,
``PullParameters``) uses it; the four stream messages share one shape::

    message XRequest { oneof content { TensorBundleHeader header = 1; bytes chunk = 2; } }

so a chunk message is exactly ``0x12 <varint length> <bytes>``. This module writes that by hand
(:func:`encode_chunk`, one copy of the payload, where the protobuf runtime costs a copy on
construct and another on serialize) and reads it by hand (:func:`decode_frame` returns a
``memoryview`` into the received message: zero-copy), falling back to the protobuf runtime for
anything that is not exactly one chunk field, so any gRPC client that speaks the ``.proto`` is
understood. ``tests/unit/test_transport.py`` checks the hand encoding byte for byte against the
runtime.

A bundle small enough (at most :data:`MAX_INLINE_BYTES`; the learner's ``SHOAL_INLINE_KB``)
may instead travel as the header alone, its bytes in ``inline_data`` (:func:`inline_bytes`),
with no chunk after it; :func:`inline_of` checks such a header (exactly ``total_bytes``, never
with ``shared_memory``, at most :data:`MAX_INLINE_BYTES`).

Chunk boundaries are chosen on element boundaries (:func:`chunk_ranges`), so the receiver can
reduce whole elements straight out of each chunk; :class:`BundleReceiver` still handles a
sender that splits elements (it carries the partial element over to the next chunk).

Nothing here imports gRPC: the codec is plain bytes in, bytes out, so that a same-host
shared-memory lane can replace the gRPC stream without touching the protocol above it. It lives
in the client distribution (``shoal.contract``) because both the learner and the
parameter-sync shards speak it; ``torch`` and ``numpy`` are imported only by the functions that
take or make tensors (:data:`DTYPES`, :func:`byte_view`, :func:`tensors_from_buffer`,
:attr:`TensorMeta.torch_dtype`), so that importing the codec, validating a layout, or encoding
and decoding frames needs neither.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPES",  # noqa: F822 - built on first access (module __getattr__)
    "DTYPE_SIZES",
    "MAX_CHUNK_BYTES",
    "MAX_INLINE_BYTES",
    "MIN_CHUNK_BYTES",
    "BundleError",
    "BundleReceiver",
    "BundleTooLarge",
    "Frame",
    "TensorMeta",
    "byte_view",
    "chunk_ranges",
    "decode_frame",
    "dtype_name",
    "encode_chunk",
    "encode_chunks",
    "encode_header",
    "header_of",
    "inline_bytes",
    "inline_of",
    "metas_from_header",
    "pack_layout",
    "serialize",
    "tensors_from_buffer",
    "validate_layout",
]

MiB = 1024 * 1024
MIN_CHUNK_BYTES = 1 * MiB
MAX_CHUNK_BYTES = 4 * MiB
#: The default chunk size: in bench/bench_sync.py 1 MiB chunks make a ResNet-18 round about
#: 20% faster than 4 MiB ones (the receiver starts working on the first bytes sooner).
DEFAULT_CHUNK_BYTES = 1 * MiB
#: The most bytes a header may carry inline (``TensorBundleHeader.inline_data``): a bundle of
#: at most this many bytes may travel as one message; never more than a chunk may carry.
MAX_INLINE_BYTES = MAX_CHUNK_BYTES

_CHUNK_TAG = 0x12  # field 2, wire type 2 (length-delimited)
_HEADER_TAG = 0x0A  # field 1, wire type 2

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("shoal's tensor transport needs a little-endian host")


# ------------------------------------------------------------------------------------------
# dtypes and layouts
# ------------------------------------------------------------------------------------------

#: Wire dtype names (``str(torch.float32)`` without ``torch.``) to their element size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

_torch_dtypes: dict[str, torch.dtype] = {}


def _dtypes() -> dict[str, torch.dtype]:
    """Wire dtype names to torch dtypes (imports torch on first use)."""
    if not _torch_dtypes:
        import torch

        _torch_dtypes.update({name: getattr(torch, name) for name in DTYPE_SIZES})
    return _torch_dtypes


def __getattr__(name: str) -> Any:
    # ``DTYPES`` (wire name -> torch dtype) is built on first access, so that importing this
    # module does not import torch.
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the name on the wire)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype ({name!r}) is not supported on the wire: {sorted(DTYPE_SIZES)}")
    return name


class BundleError(ValueError):
    """A bundle's header or bytes are inconsistent (the message names the field and value)."""


class BundleTooLarge(BundleError):
    """More bytes arrived than the header declared."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a bundle (the ``TensorInfo`` of the proto)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    buffer: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtypes()[self.dtype]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def same_tensor(self, other: TensorMeta) -> bool:
        """Same name, dtype, shape, size and kind (offsets may differ between streams)."""
        return (self.name, self.dtype, self.shape, self.nbytes, self.buffer) == (
            other.name,
            other.dtype,
            other.shape,
            other.nbytes,
            other.buffer,
        )

    def at(self, offset: int) -> TensorMeta:
        return TensorMeta(self.name, self.dtype, self.shape, offset, self.nbytes, self.buffer)

    def to_proto(self) -> ps_pb2.TensorInfo:
        return ps_pb2.TensorInfo(
            name=self.name,
            dtype=self.dtype,
            shape=list(self.shape),
            offset=self.offset,
            nbytes=self.nbytes,
            buffer=self.buffer,
        )

    @classmethod
    def from_proto(cls, info: ps_pb2.TensorInfo) -> TensorMeta:
        return cls(
            info.name,
            info.dtype,
            tuple(int(d) for d in info.shape),
            info.offset,
            info.nbytes,
            info.buffer,
        )

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, *, buffer: bool = False) -> TensorMeta:
        """The meta of ``tensor`` at offset 0 (see :func:`pack_layout`)."""
        nbytes = tensor.numel() * tensor.element_size()
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape), 0, nbytes, buffer)


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


def pack_layout(metas: Sequence[TensorMeta], *, align: int = 1) -> tuple[list[TensorMeta], int]:
    """Give ``metas`` consecutive offsets (each rounded up to ``align`` bytes); returns the
    placed metas and the total size."""
    placed, offset = [], 0
    for meta in metas:
        offset = _align_up(offset, align)
        placed.append(meta.at(offset))
        offset += meta.nbytes
    return placed, offset


def validate_layout(
    metas: Sequence[TensorMeta], total_bytes: int, *, what: str = "tensors"
) -> None:
    """Raise :class:`BundleError` unless ``metas`` describe a well-formed bundle of
    ``total_bytes``: known dtypes, non-negative shapes, ``nbytes`` equal to elements x element
    size, unique names, ascending non-overlapping offsets inside ``total_bytes``."""
    if total_bytes < 0:
        raise BundleError(f"total_bytes ({total_bytes}) must be >= 0")
    seen: set[str] = set()
    end = 0
    for i, m in enumerate(metas):
        where = f"{what}[{i}]"
        if not m.name:
            raise BundleError(f"{where}.name ('') must not be empty")
        if m.name in seen:
            raise BundleError(f"{where}.name ({m.name!r}) appears twice")
        seen.add(m.name)
        if m.dtype not in DTYPE_SIZES:
            raise BundleError(f"{where}.dtype ({m.dtype!r}) must be one of {sorted(DTYPE_SIZES)}")
        if any(d < 0 for d in m.shape):
            raise BundleError(f"{where}.shape ({list(m.shape)}) must not be negative")
        if m.nbytes != m.numel * m.itemsize:
            raise BundleError(
                f"{where}.nbytes ({m.nbytes}) must be {m.numel * m.itemsize} for "
                f"{m.dtype} {list(m.shape)} ({m.name})"
            )
        if m.offset < end:
            raise BundleError(
                f"{where}.offset ({m.offset}) overlaps the previous tensor (ends at {end})"
            )
        end = m.end
    if end > total_bytes:
        raise BundleError(f"total_bytes ({total_bytes}) is smaller than the tensors' end ({end})")


# ------------------------------------------------------------------------------------------
# messages
# ------------------------------------------------------------------------------------------


class _BundleMessage(Protocol):
    header: ps_pb2.TensorBundleHeader
    chunk: bytes

    def WhichOneof(self, name: str) -> str | None: ...

    def SerializeToString(self) -> bytes: ...


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def encode_chunk(*parts: Any) -> bytes:
    """The serialized stream message ``{chunk: b"".join(parts)}`` (any of the four bundle
    messages: they serialize identically). ``parts`` are bytes-like; they are copied once."""
    size = sum(memoryview(p).nbytes for p in parts)
    return b"".join((bytes((_CHUNK_TAG,)), _varint(size), *parts))


def encode_header(message_cls: type[Any], header: ps_pb2.TensorBundleHeader) -> bytes:
    """The serialized stream message ``{header: header}`` (by the protobuf runtime)."""
    return message_cls(header=header).SerializeToString()


def serialize(message: bytes | Any) -> bytes:
    """gRPC serializer of the bundle streams: pre-encoded bytes pass through unchanged."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


@dataclass(frozen=True)
class Frame:
    """One decoded stream message: a header, a chunk (a view into the message), a trailer
    (SyncStep only), or none of them (an empty message, which the receiver rejects)."""

    header: ps_pb2.TensorBundleHeader | None = None
    chunk: memoryview | None = None
    # SyncStepRequest only: the optional last message of a gradient stream.
    trailer: ps_pb2.TensorBundleTrailer | None = None


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            return -1, pos
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def decode_frame(message_cls: type[Any], data: bytes) -> Frame:
    """Decode one serialized stream message. A message that is exactly one ``chunk`` field
    is read by hand (zero-copy view); anything else goes through the protobuf runtime."""
    if data and data[0] == _CHUNK_TAG:
        size, pos = _read_varint(data, 1)
        if size >= 0 and pos + size == len(data):
            return Frame(chunk=memoryview(data)[pos:])
    message = message_cls.FromString(data)
    which = message.WhichOneof("content")
    if which == "header":
        return Frame(header=message.header)
    if which == "chunk":
        return Frame(chunk=memoryview(message.chunk))
    if which == "trailer":
        return Frame(trailer=message.trailer)
    return Frame()


def frame_decoder(message_cls: type[Any]) -> Callable[[bytes], Frame]:
    """A gRPC deserializer that yields :class:`Frame` objects for ``message_cls`` streams."""

    def decode(data: bytes) -> Frame:
        return decode_frame(message_cls, data)

    return decode


def header_of(
    *,
    job_id: str,
    sender_id: str,
    metas: Sequence[TensorMeta],
    total_bytes: int,
    generation: int = 0,
    iteration: int = 0,
    num_samples: int = 0,
    loss_sum: float = 0.0,
    learning_rate: float = 0.0,
    grad_norm: float = 0.0,
    step_skipped: bool = False,
) -> ps_pb2.TensorBundleHeader:
    return ps_pb2.TensorBundleHeader(
        job_id=job_id,
        sender_id=sender_id,
        generation=generation,
        iteration=iteration,
        tensors=[m.to_proto() for m in metas],
        total_bytes=total_bytes,
        num_samples=num_samples,
        loss_sum=loss_sum,
        learning_rate=learning_rate,
        grad_norm=grad_norm,
        step_skipped=step_skipped,
    )


def metas_from_header(header: ps_pb2.TensorBundleHeader) -> list[TensorMeta]:
    return [TensorMeta.from_proto(t) for t in header.tensors]


def inline_of(header: ps_pb2.TensorBundleHeader, *, what: str = "header") -> memoryview | None:
    """The bytes a header carries inline (``inline_data``), checked against the header: None
    when it carries none (its bytes follow in chunks, or in the shared-memory lane). Raises
    :class:`BundleTooLarge` over :data:`MAX_INLINE_BYTES`, :class:`BundleError` when they
    come with ``shared_memory`` or are not exactly ``total_bytes`` (the message names the
    field and the value). The layout itself is :func:`validate_layout`'s to check."""
    size = len(header.inline_data)
    if not size:
        return None
    if size > MAX_INLINE_BYTES:
        raise BundleTooLarge(
            f"{what}.inline_data ({size} bytes) exceeds the most a header may carry "
            f"({MAX_INLINE_BYTES} bytes): send the bundle in chunks"
        )
    if header.shared_memory:
        raise BundleError(
            f"{what}.inline_data ({size} bytes) must not come with {what}.shared_memory "
            "(the bytes are either inline or in the lane)"
        )
    if size != header.total_bytes:
        raise BundleError(
            f"{what}.inline_data ({size} bytes) must be {what}.total_bytes "
            f"({header.total_bytes}) bytes"
        )
    return memoryview(header.inline_data)


# ------------------------------------------------------------------------------------------
# sending
# ------------------------------------------------------------------------------------------


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"tensor on {tensor.device} must be on the CPU to be sent")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous to be viewed as bytes")
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy()


def chunk_ranges(
    metas: Sequence[TensorMeta], total_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[tuple[int, int]]:
    """Split ``[0, total_bytes)`` into ranges of at most ``chunk_bytes`` that end on element
    boundaries (a range ends inside a tensor only between two of its elements)."""
    if chunk_bytes < 16:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must be >= 16")
    ranges: list[tuple[int, int]] = []
    start, i = 0, 0
    while start < total_bytes:
        stop = min(start + chunk_bytes, total_bytes)
        if stop < total_bytes:
            while i < len(metas) and metas[i].end <= stop:
                i += 1
            if i < len(metas) and metas[i].offset < stop:
                m = metas[i]
                aligned = m.offset + (stop - m.offset) // m.itemsize * m.itemsize
                if aligned > start:
                    stop = aligned
        ranges.append((start, stop))
        start = stop
    return ranges


def inline_bytes(
    metas: Sequence[TensorMeta], sources: Sequence[np.ndarray], total_bytes: int
) -> bytes:
    """A bundle's ``total_bytes`` as one ``bytes`` (``TensorBundleHeader.inline_data``):
    ``sources[j]`` (a uint8 array) holds the bytes of ``metas[j]``, gaps are zeros. The bytes
    are exactly those :func:`encode_chunks` would send (one copy)."""
    if total_bytes > MAX_INLINE_BYTES:
        raise ValueError(
            f"total_bytes ({total_bytes}) exceeds the most a header may carry inline "
            f"({MAX_INLINE_BYTES})"
        )
    if len(metas) != len(sources):
        raise ValueError(f"{len(metas)} tensors but {len(sources)} sources")
    parts: list[Any] = []
    pos = 0
    for m, src in zip(metas, sources, strict=True):
        if src.nbytes != m.nbytes:
            raise ValueError(f"source of {m.name} has {src.nbytes} bytes, expected {m.nbytes}")
        if m.offset > pos:
            parts.append(bytes(m.offset - pos))
        parts.append(src)
        pos = m.end
    if total_bytes > pos:
        parts.append(bytes(total_bytes - pos))
    return b"".join(parts)


def encode_chunks(
    metas: Sequence[TensorMeta],
    sources: Sequence[np.ndarray],
    total_bytes: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[bytes]:
    """The chunk messages of a bundle: ``sources[j]`` (a uint8 array, see :func:`byte_view`)
    holds the bytes of ``metas[j]``; gaps between tensors are sent as zeros. Each payload byte
    is copied once, into its message."""
    if len(metas) != len(sources):
        raise ValueError(f"{len(metas)} tensors but {len(sources)} sources")
    for m, s in zip(metas, sources, strict=True):
        if s.nbytes != m.nbytes:
            raise ValueError(f"source of {m.name} has {s.nbytes} bytes, expected {m.nbytes}")
    j = 0
    for start, stop in chunk_ranges(metas, total_bytes, chunk_bytes):
        parts: list[Any] = []
        pos = start
        while pos < stop:
            while j < len(metas) and metas[j].end <= pos:
                j += 1
            if j < len(metas) and metas[j].offset <= pos:
                m = metas[j]
                upto = min(stop, m.end)
                parts.append(sources[j][pos - m.offset : upto - m.offset])
            else:
                upto = min(stop, metas[j].offset) if j < len(metas) else stop
                parts.append(bytes(upto - pos))
            pos = upto
        yield encode_chunk(*parts)


# ------------------------------------------------------------------------------------------
# receiving
# ------------------------------------------------------------------------------------------

#: ``sink(tensor_index, byte_offset_in_tensor, segment)``; segments hold whole elements.
Sink = Callable[[int, int, memoryview], None]


class BundleReceiver:
    """Routes the chunks of one bundle to ``sink`` tensor by tensor, in whole elements.

    Bytes between tensors are skipped. A chunk that would exceed ``total_bytes`` raises
    :class:`BundleTooLarge` before anything of it reaches the sink.
    """

    def __init__(self, metas: Sequence[TensorMeta], total_bytes: int, sink: Sink) -> None:
        self._metas = list(metas)
        self._total = total_bytes
        self._sink = sink
        self._pos = 0
        self._index = 0
        self._carry = bytearray()

    @property
    def received(self) -> int:
        return self._pos

    @property
    def complete(self) -> bool:
        return self._pos == self._total

    def feed(self, chunk: memoryview) -> None:
        size = chunk.nbytes
        if self._pos + size > self._total:
            raise BundleTooLarge(
                f"chunk of {size} bytes after {self._pos} exceeds total_bytes ({self._total})"
            )
        chunk = chunk.cast("B") if chunk.format != "B" else chunk
        base = self._pos
        end = base + size
        metas = self._metas
        while self._pos < end:
            while self._index < len(metas) and metas[self._index].end <= self._pos:
                self._index += 1
            if self._index >= len(metas):
                self._pos = end
                break
            m = metas[self._index]
            if self._pos < m.offset:  # padding between tensors
                self._pos = min(end, m.offset)
                continue
            upto = min(end, m.end)
            segment = chunk[self._pos - base : upto - base]
            within = self._pos - m.offset
            self._deliver(self._index, m, within, segment)
            self._pos = upto

    def _deliver(self, index: int, m: TensorMeta, within: int, segment: memoryview) -> None:
        item = m.itemsize
        if self._carry:  # complete the element split by the previous chunk
            have = len(self._carry)
            take = min(item - have, segment.nbytes)
            self._carry += segment[:take]
            segment = segment[take:]
            if len(self._carry) == item:
                self._sink(index, within - have, memoryview(bytes(self._carry)))
                self._carry.clear()
            within += take
            if not segment.nbytes:
                return
        whole = segment.nbytes // item * item
        if whole:
            self._sink(index, within, segment[:whole])
        if whole < segment.nbytes:
            self._carry += segment[whole:]

    def finish(self) -> None:
        if self._pos != self._total:
            raise BundleError(
                f"stream ended after {self._pos} of total_bytes ({self._total}) bytes"
            )


def tensors_from_buffer(
    buffer: bytearray | memoryview, metas: Sequence[TensorMeta]
) -> list[torch.Tensor]:
    """Tensors viewing ``buffer`` (writable, no copy) at the metas' offsets. Offsets that are not
    a multiple of the element size are copied into a fresh tensor instead."""
    import torch

    out = []
    for m in metas:
        dtype = m.torch_dtype
        if m.numel == 0:
            out.append(torch.empty(m.shape, dtype=dtype))
        elif m.offset % m.itemsize == 0:
            out.append(
                torch.frombuffer(buffer, dtype=dtype, count=m.numel, offset=m.offset).view(m.shape)
            )
        else:
            raw = bytearray(memoryview(buffer)[m.offset : m.end])
            out.append(torch.frombuffer(raw, dtype=dtype).view(m.shape))
    return out
