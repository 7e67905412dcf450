"""The progressive SyncStep answer on two in-process shards: a commit steps its slice group by
group, and the learner's answer carries the header and the chunks of the groups already
stepped while the commit is still held after its first group (a test seam on the shard); the
rest follows once it goes on, and the parameters received are the stepped ones."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.contract.wire import (
    BundleReceiver,
    TensorMeta,
    byte_view,
    encode_chunks,
    encode_header,
    header_of,
    pack_layout,
)
from shoal.learner.grpc_backend import stream_methods
from shoal.param_sync import service
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2
from tests.integration.shard_bed import start_shard
from tests.integration.test_param_sync import (
    BY_NAME,
    MAX_MESSAGE,
    Cluster,
    grads,
    initial,
    of_shard,
    started,
)
from tests.support import make_tokens

LR = 0.5  # the Cluster's default optimizer: SGD {"lr": 0.5}
WAIT = 60.0


class SmallChunkCluster(Cluster):
    """The two shards answer in 16-byte chunks and step each tensor as its own group."""

    async def start(self) -> SmallChunkCluster:
        for i in range(2):
            shard = await start_shard(
                self.tokens_file,
                self.tokens["service"],
                self.storage_uri,
                shard_index=i,
                chunk_bytes=16,
                step_group_bytes=1,
                max_message_bytes=MAX_MESSAGE,
            )
            self.shards.append(shard)
        return self


@pytest.fixture
async def small(tmp_path: Path, monkeypatch) -> AsyncIterator[SmallChunkCluster]:
    # The commit on the compute thread, as for a slice of more than INLINE_COMPUTE_BYTES (a
    # slice this small is stepped in the event loop, in one go): the test holds that thread.
    monkeypatch.setattr(service, "INLINE_COMPUTE_BYTES", -1)
    tokens = make_tokens(tmp_path / "tokens")
    c = await SmallChunkCluster(tmp_path, tokens, tmp_path / "tokens").start()
    try:
        yield c
    finally:
        await c.stop()


def request_stream(
    c: Cluster, learner: str, a: Any, tensors: dict[str, torch.Tensor], n: int
) -> AsyncIterator[bytes]:
    names = [m.name for m in pack_layout(list(BY_NAME.values()))[0] if m.name in tensors]
    metas, total = pack_layout([BY_NAME[x] for x in names])
    header = header_of(
        job_id="j",
        sender_id=learner,
        metas=metas,
        total_bytes=total,
        generation=a.generation,
        iteration=a.global_iteration,
        num_samples=n,
    )

    async def messages() -> AsyncIterator[bytes]:
        yield encode_header(ps_pb2.SyncStepRequest, header)
        for chunk in encode_chunks(metas, [byte_view(tensors[x]) for x in names], total, 16):
            yield chunk

    return messages()


async def test_the_answer_sends_the_header_and_stepped_chunks_while_the_commit_is_held(small):
    c = small
    (a,) = await started(c, "j", ["l1"])
    # The shard holding several tensors: its first group (tensor) is stepped, the rest not.
    s = max((0, 1), key=lambda i: len(c.names(i)))
    assert len(c.names(s)) >= 2, c.slices
    sj = c.servicers[s]._slices["j"].job
    assert len(sj.step_groups) == len(sj.metas) >= 2
    first_mark = sj.step_groups[0][1]
    assert 0 < first_mark < sj.total_bytes

    held, go = threading.Event(), threading.Event()

    def hold(number: int) -> None:  # on the shard's compute thread
        if number == 0:
            held.set()
            go.wait(WAIT)

    sj.group_stepped = hold
    g = grads(1)
    buffers = {"bn.running_mean": torch.full((4,), 2.0), "bn.num_batches_tracked": torch.tensor(5)}
    tensors = {**g, **buffers}
    other = 1 - s
    try:
        other_answer = asyncio.ensure_future(
            c.sync(
                "j",
                "l1",
                other,
                generation=a.generation,
                iteration=a.global_iteration,
                tensors=of_shard(c, other, tensors),
                n=2,
            )
        )
        streams = stream_methods(c._channel(c.addresses[s]))
        call = streams["SyncStep"](
            request_stream(c, "l1", a, of_shard(c, s, tensors), 2), metadata=c.md()
        )
        frames = aiter(call)
        first = await asyncio.wait_for(anext(frames), WAIT)
        header = first.header
        assert header.iteration == a.global_iteration and header.num_samples == 2
        metas = [TensorMeta.from_proto(t) for t in header.tensors]
        out = {m.name: torch.zeros(m.shape, dtype=m.torch_dtype) for m in metas}
        views = [byte_view(out[m.name]) for m in metas]

        def sink(i: int, off: int, seg: memoryview) -> None:
            views[i][off : off + seg.nbytes] = bytearray(seg)

        receiver = BundleReceiver(metas, header.total_bytes, sink)
        while receiver.received < first_mark:  # the first group's chunks: sent while held
            frame = await asyncio.wait_for(anext(frames), WAIT)
            receiver.feed(frame.chunk)
        # The compute thread marks the group stepped, then reaches the seam: it may not be
        # there yet when the chunks already arrived.
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, held.wait, WAIT)
        assert not go.is_set()
        assert sj.encoded is not None and sj.encoded.stepped == first_mark < sj.total_bytes
        assert sj.completed == a.global_iteration  # the commit has not finished
        go.set()
        async for frame in frames:
            receiver.feed(frame.chunk)
        receiver.finish()
        await asyncio.wait_for(other_answer, WAIT)
    finally:
        go.set()
    p0 = initial()
    for name, value in out.items():
        if name in g:
            torch.testing.assert_close(value, p0[name] - LR * g[name], atol=1e-6, rtol=0)
        else:
            assert torch.equal(value, buffers[name]), name
    assert sj.completed == a.global_iteration + 1
    pulled = await c.pull("j", s)
    assert all(torch.equal(pulled[k], v) for k, v in out.items())
