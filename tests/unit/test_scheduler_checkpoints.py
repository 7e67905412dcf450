"""JobSchedulerService's GetCallerIdentity, ListCheckpoints and DownloadCheckpoint, in process
(port 0, MemoryStore, real auth), over checkpoints written by the data plane's own writer
(shoal.param_sync.checkpoint): complete ones are listed with their files, incomplete ones are
not, and only the files a manifest names can be downloaded, by the job's owner or an admin.
Retention (``prune_checkpoints``) keeps the newest N complete checkpoints and never the one
``latest`` names nor one being written; ``resume_from`` copies a checkpoint into a new job."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from shoal.param_sync import checkpoint as ckpt
from shoal.v1 import auth_pb2, job_scheduler_service_pb2 as js
from tests.unit.test_scheduler_service import Bed, bed, submit, upload

__all__ = ["bed"]  # the fixture, imported for the tests below


def write_checkpoint(
    b: Bed, job_id: str, iteration: int, *, shards: int = 2, **extra: object
) -> dict[str, bytes]:
    """A complete checkpoint as the coordinator writes it: shard files, manifest, latest."""
    directory = ckpt.job_uri(b.storage.uri, job_id, "checkpoints", ckpt.checkpoint_name(iteration))
    files: dict[str, bytes] = {}
    entries = []
    for i in range(shards):
        name = f"shard-{i}.safetensors"
        data = f"tensors of shard {i} at {iteration}".encode() * (1000 * (i + 1))
        ckpt.atomic_write(ckpt.join_uri(directory, name), data)
        files[name] = data
        entries.append(
            {
                "index": i,
                "file": name,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    manifest = {
        "job_id": job_id,
        "iteration": iteration,
        "epoch": iteration // 10,
        "generation": 3,
        "shards": entries,
        "time": 1_735_689_600.0 + iteration,
        **extra,
    }
    ckpt.write_manifest_and_latest(directory, manifest)
    return files


async def download(b: Bed, job_id: str, checkpoint: str, file: str, who: str = "user"):
    request = js.DownloadCheckpointRequest(job_id=job_id, checkpoint=checkpoint, file=file)
    return [m async for m in b.stub(who).DownloadCheckpoint(request)]


async def test_caller_identity_names_the_principal_and_role_of_each_token(bed: Bed) -> None:
    got = {
        who: await bed.stub(who).GetCallerIdentity(js.GetCallerIdentityRequest())
        for who in ("user", "other", "admin", "service")
    }
    assert (got["user"].principal, got["user"].role) == ("alice", auth_pb2.PRINCIPAL_ROLE_USER)
    assert (got["other"].principal, got["other"].role) == ("bob", auth_pb2.PRINCIPAL_ROLE_USER)
    assert (got["admin"].principal, got["admin"].role) == ("root", auth_pb2.PRINCIPAL_ROLE_ADMIN)
    assert got["service"].role == auth_pb2.PRINCIPAL_ROLE_SERVICE


async def test_caller_identity_needs_a_valid_token(bed: Bed) -> None:
    bed.tokens["forged"] = "f" * 64
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await bed.stub("forged").GetCallerIdentity(js.GetCallerIdentityRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_complete_checkpoints_are_listed_oldest_first_with_their_files(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    files = write_checkpoint(bed, job.job_id, 20)
    write_checkpoint(bed, job.job_id, 100)
    write_checkpoint(bed, job.job_id, 40, shards=1)
    # An interrupted checkpoint: shard files but no manifest. Never listed.
    partial = ckpt.job_uri(bed.storage.uri, job.job_id, "checkpoints", "iter-120")
    ckpt.atomic_write(ckpt.join_uri(partial, "shard-0.safetensors"), b"half")

    got = await bed.stub().ListCheckpoints(js.ListCheckpointsRequest(job_id=job.job_id))
    assert [c.name for c in got.checkpoints] == ["iter-20", "iter-40", "iter-100"]
    assert [c.latest for c in got.checkpoints] == [False, True, False]  # written last
    first = got.checkpoints[0]
    assert (first.iteration, first.epoch, first.generation) == (20, 2, 3)
    assert first.create_time.seconds == 1_735_689_620
    names = [f.name for f in first.files]
    assert names == ["manifest.json", "shard-0.safetensors", "shard-1.safetensors"]
    assert first.files[1].sha256 == hashlib.sha256(files["shard-0.safetensors"]).hexdigest()
    assert first.size_bytes == sum(f.size_bytes for f in first.files)
    assert got.next_page_token == ""


async def test_checkpoints_page_by_name_and_a_bad_token_is_refused(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    for iteration in (5, 10, 15):
        write_checkpoint(bed, job.job_id, iteration, shards=1)
    seen, token = [], ""
    while True:
        page = await bed.stub().ListCheckpoints(
            js.ListCheckpointsRequest(job_id=job.job_id, page_size=2, page_token=token)
        )
        seen += [c.name for c in page.checkpoints]
        token = page.next_page_token
        if not token:
            break
    assert seen == ["iter-5", "iter-10", "iter-15"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await bed.stub().ListCheckpoints(
            js.ListCheckpointsRequest(job_id=job.job_id, page_token="../../etc")
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token ('../../etc')" in (caught.value.details() or "")


async def test_a_checkpoint_file_downloads_with_its_size_and_sha256(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    files = write_checkpoint(bed, job.job_id, 30)
    messages = await download(bed, job.job_id, "iter-30", "shard-1.safetensors")
    data = files["shard-1.safetensors"]
    assert messages[0].header.name == "shard-1.safetensors"
    assert messages[0].header.size_bytes == len(data)
    assert messages[0].header.sha256 == hashlib.sha256(data).hexdigest()
    assert b"".join(m.chunk for m in messages[1:]) == data
    manifest = await download(bed, job.job_id, "iter-30", "manifest.json", who="admin")
    assert b'"iteration": 30' in b"".join(m.chunk for m in manifest[1:])


@pytest.mark.parametrize(
    ("checkpoint", "file", "code"),
    [
        ("iter-30", "../../../tokens", grpc.StatusCode.NOT_FOUND),
        ("iter-30", "shard-9.safetensors", grpc.StatusCode.NOT_FOUND),
        ("iter-30", "", grpc.StatusCode.NOT_FOUND),
        ("iter-31", "manifest.json", grpc.StatusCode.NOT_FOUND),
        ("../iter-30", "manifest.json", grpc.StatusCode.INVALID_ARGUMENT),
        ("iter-30/../iter-30", "manifest.json", grpc.StatusCode.INVALID_ARGUMENT),
        ("latest", "manifest.json", grpc.StatusCode.INVALID_ARGUMENT),
        ("iter-30\x00", "manifest.json", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_only_files_a_manifest_names_can_be_downloaded(
    bed: Bed, checkpoint: str, file: str, code: grpc.StatusCode
) -> None:
    job = await submit(bed, await upload(bed))
    write_checkpoint(bed, job.job_id, 30)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await download(bed, job.job_id, checkpoint, file)
    assert caught.value.code() == code


async def test_a_manifest_naming_a_path_outside_its_directory_lists_and_serves_nothing_there(
    bed: Bed,
) -> None:
    job = await submit(bed, await upload(bed))
    directory = ckpt.job_uri(bed.storage.uri, job.job_id, "checkpoints", "iter-7")
    ckpt.write_manifest_and_latest(
        directory,
        {"iteration": 7, "shards": [{"file": "../../../../artifacts/x.json", "size": 1}]},
    )
    got = await bed.stub().ListCheckpoints(js.ListCheckpointsRequest(job_id=job.job_id))
    assert [f.name for f in got.checkpoints[0].files] == ["manifest.json"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await download(bed, job.job_id, "iter-7", "../../../../artifacts/x.json")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_another_users_checkpoints_are_not_found(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    write_checkpoint(bed, job.job_id, 10, shards=1)
    for call in (
        bed.stub("other").ListCheckpoints(js.ListCheckpointsRequest(job_id=job.job_id)),
        download(bed, job.job_id, "iter-10", "manifest.json", who="other"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await bed.stub("admin").ListCheckpoints(js.ListCheckpointsRequest(job_id=job.job_id))
    assert [c.name for c in listed.checkpoints] == ["iter-10"]


async def test_a_job_without_checkpoints_lists_none(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    got = await bed.stub().ListCheckpoints(js.ListCheckpointsRequest(job_id=job.job_id))
    assert list(got.checkpoints) == []


async def names(b: Bed, job_id: str) -> list[str]:
    reply = await b.stub("user").ListCheckpoints(js.ListCheckpointsRequest(job_id=job_id))
    return [c.name for c in reply.checkpoints]


async def test_retention_keeps_the_newest_complete_ones_and_never_one_being_written(
    bed: Bed,
) -> None:
    job = await submit(bed, await upload(bed))
    for k in (10, 20, 30, 40, 50):
        write_checkpoint(bed, job.job_id, k)
    root = ckpt.job_uri(bed.storage.uri, job.job_id, "checkpoints")
    ckpt.atomic_write(ckpt.join_uri(root, "iter-5", "shard-0.safetensors"), b"interrupted")
    ckpt.atomic_write(ckpt.join_uri(root, "iter-60", "shard-0.safetensors"), b"being written")

    deleted, reclaimed = ckpt.prune_checkpoints(bed.storage.uri, job.job_id, 2)
    assert deleted == ["iter-5", "iter-10", "iter-20", "iter-30"]
    assert reclaimed > 3 * 3000
    assert await names(bed, job.job_id) == ["iter-40", "iter-50"]
    assert (
        ckpt.read_bytes(ckpt.join_uri(root, "iter-60", "shard-0.safetensors")) == b"being written"
    )
    assert ckpt.prune_checkpoints(bed.storage.uri, job.job_id, 2) == ([], 0)  # nothing more

    # 0 is the default (3); the checkpoint `latest` names is kept even when it is older.
    other = await submit(bed, await upload(bed))
    for k in (1, 2, 3, 4, 5):
        write_checkpoint(bed, other.job_id, k)
    ckpt.atomic_write(
        ckpt.join_uri(ckpt.job_uri(bed.storage.uri, other.job_id, "checkpoints"), "latest"),
        b"iter-1",
    )
    deleted, _ = ckpt.prune_checkpoints(bed.storage.uri, other.job_id, 0)
    assert deleted == []  # iter-1 is kept (latest), so nothing older than it goes
    ckpt.atomic_write(
        ckpt.join_uri(ckpt.job_uri(bed.storage.uri, other.job_id, "checkpoints"), "latest"),
        b"iter-5",
    )
    deleted, _ = ckpt.prune_checkpoints(bed.storage.uri, other.job_id, 0)
    assert deleted == ["iter-1", "iter-2"]
    assert await names(bed, other.job_id) == ["iter-3", "iter-4", "iter-5"]


async def test_a_negative_keep_checkpoints_is_refused_naming_the_field(bed: Bed) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, await upload(bed), keep_checkpoints=-1)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.keep_checkpoints" in caught.value.details() and "-1" in caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, await upload(bed), keep_every_nth_checkpoint=-2)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.keep_every_nth_checkpoint" in (caught.value.details() or "")


async def test_retention_keeps_every_nth_checkpoint_for_good_and_counts_them_the_same_later(
    bed: Bed,
) -> None:
    """A checkpoint every 2 epochs (iteration 10 per epoch here), keep the newest 2 and every
    3rd: the checkpoints at epochs 6, 12, ... stay however many come after them."""
    job = await submit(bed, await upload(bed))
    for k in (20, 40, 60, 80, 100):  # epochs 2, 4, 6, 8, 10: the 1st to the 5th checkpoint
        write_checkpoint(bed, job.job_id, k, checkpoint_every=2)
    deleted, _ = ckpt.prune_checkpoints(bed.storage.uri, job.job_id, 2, 3)
    assert deleted == ["iter-20", "iter-40"]
    assert await names(bed, job.job_id) == ["iter-60", "iter-80", "iter-100"]
    for k in (120, 140, 160):  # the 6th (epoch 12: kept for good), the 7th and the 8th
        write_checkpoint(bed, job.job_id, k, checkpoint_every=2)
        ckpt.prune_checkpoints(bed.storage.uri, job.job_id, 2, 3)
    assert await names(bed, job.job_id) == ["iter-60", "iter-120", "iter-140", "iter-160"]
    # Without every-Nth (0) the same storage keeps only the newest 2.
    deleted, _ = ckpt.prune_checkpoints(bed.storage.uri, job.job_id, 2, 0)
    assert deleted == ["iter-60", "iter-120"]


async def test_resume_from_copies_the_checkpoint_into_the_new_job(bed: Bed) -> None:
    artifact = await upload(bed)
    source = await submit(bed, artifact)
    files = write_checkpoint(bed, source.job_id, 20, batch_size=64, seed=0)
    write_checkpoint(bed, source.job_id, 40, batch_size=64, seed=0)

    job = await submit(bed, artifact, epochs=5, resume_from=f"{source.job_id}/iter-20")
    assert job.spec.resume_from == f"{source.job_id}/iter-20"
    assert await names(bed, job.job_id) == ["iter-20"]
    found = ckpt.latest_checkpoint(bed.storage.uri, job.job_id)
    assert found is not None and found[1]["iteration"] == 20  # what the data plane resumes from
    for name, data in files.items():
        got = b"".join(m.chunk for m in await download(bed, job.job_id, "iter-20", name) if m.chunk)
        assert got == data
    newest = await submit(bed, artifact, epochs=5, resume_from=source.job_id)  # iter-40
    assert await names(bed, newest.job_id) == ["iter-40"]


@pytest.mark.parametrize(
    ("value", "code", "words"),
    [
        ("{job}/iter-99", "NOT_FOUND", ["'iter-99' of job", "(it has: iter-20, iter-40)"]),
        ("job-nope", "NOT_FOUND", ["job-nope"]),
        ("{job}/latest", "INVALID_ARGUMENT", ["spec.resume_from", "iter-120"]),
        ("{job}/iter-20", "INVALID_ARGUMENT", ["spec.batch_size", "(32)"]),
        ("{job}/iter-40", "INVALID_ARGUMENT", ["spec.epochs (3)", "the 4 epochs", "iter-40"]),
    ],
)
async def test_a_bad_resume_from_is_refused_and_creates_nothing(
    bed: Bed, value: str, code: str, words: list[str]
) -> None:
    artifact = await upload(bed)
    source = await submit(bed, artifact)
    write_checkpoint(bed, source.job_id, 20, batch_size=32, seed=0)
    write_checkpoint(bed, source.job_id, 40, batch_size=64, seed=0)  # epoch 4
    before = await bed.stub("admin").ListJobs(js.ListJobsRequest(page_size=100))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, artifact, epochs=3, resume_from=value.format(job=source.job_id))
    assert caught.value.code().name == code, caught.value.details()
    for word in words:
        assert word in caught.value.details(), caught.value.details()
    after = await bed.stub("admin").ListJobs(js.ListJobsRequest(page_size=100))
    assert len(after.jobs) == len(before.jobs)


async def test_another_users_job_cannot_be_resumed_from(bed: Bed) -> None:
    source = await submit(bed, await upload(bed))
    write_checkpoint(bed, source.job_id, 20)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, await upload(bed, who="other"), who="other", resume_from=source.job_id)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
