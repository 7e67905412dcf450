"""Datasets from object storage: a real S3-compatible server (moto's server mode, a separate
process on loopback started by this test), the job's dataset URIs as the host agent passes
them (SHOAL_DATASET_URIS), read by the learner through fsspec's s3fs. Nothing is mocked on the
client side: s3fs speaks HTTP to the server. The same for gs:// URIs, through gcsfs against
gcp-storage-emulator (a GCS JSON-API server from PyPI, a separate process on loopback; gcsfs
finds it through STORAGE_EMULATOR_HOST, as it would find a fake-gcs-server)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from shoal.learner import ElasticTrainer, LearnerEnv, data
from tests.support import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
BUCKET = "datasets"

# gcsfs's experimental zonal/HNS support (on by default, read when gcsfs is imported) asks the
# Storage Control gRPC API for each bucket's type; the emulator speaks only the JSON API, so
# each new client would spend ~100 s in gRPC retries before falling back to the plain
# GCSFileSystem it then uses anyway. Real GCS answers that call.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto")


def _server(argv: list[str], probe: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server process on loopback, up once ``probe`` answers; stopped after."""
    log = log_path.open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def up() -> bool:
        try:
            with urllib.request.urlopen(probe, timeout=2):
                return True
        except OSError:
            return proc.poll() is not None  # fail fast below when it died

    try:
        wait_until(up, timeout=60, what=f"{argv[2]} up")
        assert proc.poll() is None, f"{argv[2]} exited: {log_path.read_text()[-2000:]}"
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    for _ in _server(argv, f"{endpoint}/moto-api/", log):
        yield endpoint


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    return client


def digits() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_s3", REPO / "examples/digits/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_datasets()


def get_datasets(uris: list[str]):
    """What a user script writes: the job's URIs in, datasets out."""
    return data.tensor_dataset(uris[0]), data.tensor_dataset(uris[1])


def train(datasets, env: LearnerEnv) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    trainer = ElasticTrainer(
        model, datasets, nn.CrossEntropyLoss(), ("SGD", {"lr": 0.05}), device="cpu", env=env
    )
    return trainer.train(epochs=1, batch_size=128).params


def test_a_job_trains_on_datasets_read_from_an_s3_compatible_server(s3) -> None:
    train_set, test_set = digits()
    for key, ds in (("digits/train.safetensors", train_set), ("digits/test.safetensors", test_set)):
        x, y = ds.tensors
        s3.put_object(Bucket=BUCKET, Key=key, Body=safetensors.torch.save({"x": x, "y": y}))
    uris = f"s3://{BUCKET}/digits/train.safetensors,s3://{BUCKET}/digits/test.safetensors"
    env = LearnerEnv.from_environ({"SHOAL_DATASET_URIS": uris})
    assert env.dataset_uris == tuple(uris.split(","))

    from_s3 = train(get_datasets, env)
    from_memory = train(lambda: (train_set, test_set), LearnerEnv())
    assert from_s3.keys() == from_memory.keys()
    assert all(torch.equal(from_s3[k], from_memory[k]) for k in from_s3)


def test_a_missing_object_or_key_fails_naming_it(s3) -> None:
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        data.read_bytes(f"s3://{BUCKET}/nothing-here.safetensors")
    s3.put_object(
        Bucket=BUCKET, Key="only-x.safetensors", Body=safetensors.torch.save({"x": torch.ones(2)})
    )
    with pytest.raises(ValueError, match=r"only-x.safetensors holds no tensor \['y'\]"):
        data.tensor_dataset(f"s3://{BUCKET}/only-x.safetensors")


def test_bad_dataset_uris_are_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=r"SHOAL_DATASET_URIS \('s3://a,relative/path'\)"):
        LearnerEnv.from_environ({"SHOAL_DATASET_URIS": "s3://a,relative/path"})
    with pytest.raises(ValueError, match=r"dataset URI \('data.bin'\) must name a scheme"):
        data.read_bytes("data.bin")


@pytest.fixture(scope="module")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "gcp_storage_emulator",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--in-memory",
        "--default-bucket",
        BUCKET,
    ]
    log = tmp_path_factory.mktemp("gcs") / "gcs.log"
    for _ in _server(argv, f"{endpoint}/storage/v1/b", log):
        yield endpoint


@pytest.fixture
def gcs(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    import fsspec

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    fsspec.filesystem("gs").clear_instance_cache()
    return fsspec.filesystem("gs", token="anon", skip_instance_cache=True)


def test_a_job_trains_on_datasets_read_from_a_gcs_server(gcs) -> None:
    train_set, test_set = digits()
    for key, ds in (("digits/train.safetensors", train_set), ("digits/test.safetensors", test_set)):
        x, y = ds.tensors
        gcs.pipe_file(f"{BUCKET}/{key}", safetensors.torch.save({"x": x, "y": y}))
    uris = f"gs://{BUCKET}/digits/train.safetensors,gs://{BUCKET}/digits/test.safetensors"
    env = LearnerEnv.from_environ({"SHOAL_DATASET_URIS": uris})

    from_gcs = train(get_datasets, env)
    from_memory = train(lambda: (train_set, test_set), LearnerEnv())
    assert from_gcs.keys() == from_memory.keys()
    assert all(torch.equal(from_gcs[k], from_memory[k]) for k in from_gcs)
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        data.read_bytes(f"gs://{BUCKET}/nothing-here.safetensors")


def test_a_jobs_records_on_s3_are_appended_as_objects_and_read_whole(s3, monkeypatch) -> None:
    """The coordinator's record appends on a real S3 server (shoal.contract.records): an
    object each, never the file put again; compacted as they accumulate; read back whole by
    the coordinator (``checkpoint.read_records``) and by the scheduler (GetJobMetrics'
    ``Storage.read_metrics``); a truncation after a resume leaves one object."""
    import asyncio
    import json

    from shoal.contract import records
    from shoal.param_sync import checkpoint as ckpt
    from shoal.scheduler.artifacts import Storage, read_jsonl_metrics
    from shoal.v1 import job_pb2

    monkeypatch.setattr(records, "SEGMENT_AFTER", 5)
    monkeypatch.setattr(records, "WHOLE_AFTER", 3)
    storage = f"s3://{BUCKET}/records"
    uri = ckpt.job_uri(storage, "j", "metrics", "iterations.jsonl")
    lines = [
        json.dumps({"epoch": i // 10, "iteration": i % 10, "loss": 1 / (i + 1)}) for i in range(40)
    ]
    for line in lines:
        ckpt.append_line(uri, line)
    assert ckpt.read_records(uri) == "".join(f"{x}\n" for x in lines).encode()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="records/")["Contents"]
    keys = [o["Key"] for o in listed]
    assert all(k.startswith("records/jobs/j/metrics/iterations.jsonl.parts/") for k in keys)
    assert len(keys) < 1 + records.WHOLE_AFTER + records.SEGMENT_AFTER  # compacted

    text = asyncio.run(Storage(storage).read_metrics("j", "iterations.jsonl"))
    got = read_jsonl_metrics(text, job_pb2.IterationMetric)
    assert [(m.epoch, m.iteration) for m in got] == [(i // 10, i % 10) for i in range(40)]

    ckpt.rewrite_records(uri, "".join(f"{x}\n" for x in lines[:10]).encode())
    ckpt.append_line(uri, lines[10])
    assert ckpt.read_records(uri) == "".join(f"{x}\n" for x in lines[:11]).encode()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="records/")["Contents"]
    assert len(listed) == 2  # the rewrite's whole and one append after it
