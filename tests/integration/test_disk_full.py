"""A full disk during an artifact upload, on a real small filesystem: the job-scheduler process
runs in its own user and mount namespaces (``unshare -rm``, no root needed) with its storage on
a 512 KiB tmpfs. An upload bigger than the space left fails with RESOURCE_EXHAUSTED
(ERROR_REASON_STORAGE_FULL) naming the storage, not INTERNAL; nothing partial is kept, so a
small upload right after succeeds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from shoal.client import Client, ClientConfig, ShoalClientError
from tests.support import free_port, wait_until


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null"],
        capture_output=True,
    )
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _unshare_works(), reason="needs user namespaces (unshare -rm) to mount a small tmpfs"
)


def test_an_upload_onto_a_full_disk_is_resource_exhausted_and_leaves_nothing(tmp_path):
    storage = tmp_path / "storage"
    storage.mkdir()
    port = free_port()
    script = (
        f"mount -t tmpfs -o size=512k tmpfs {storage} && exec {sys.executable} -m "
        f"shoal.runtime.main job-scheduler --listen 127.0.0.1:{port} --insecure-no-auth "
        f"--storage-uri {storage.as_uri()} --max-artifact-mb 8 "
        f"--resource-managers 127.0.0.1:{free_port()} --sync-shards 127.0.0.1:{free_port()}"
    )
    log = (tmp_path / "scheduler.log").open("wb")
    proc = subprocess.Popen(
        ["unshare", "-rm", "sh", "-c", script],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        config = ClientConfig(scheduler=(f"127.0.0.1:{port}",))
        with Client(config, timeout=10, retries=3) as client:
            wait_until(lambda: _answers(client), timeout=60)
            big = os.urandom(1024 * 1024)  # 1 MiB onto 512 KiB
            with pytest.raises(ShoalClientError) as full:
                client.upload_artifact(big, name="too-big")
            assert full.value.code == "RESOURCE_EXHAUSTED", full.value
            assert full.value.reason == "ERROR_REASON_STORAGE_FULL"
            assert "is full" in full.value.message and "too-big" in full.value.message
            small = client.upload_artifact(b"x" * 1000, name="small")  # the space came back
            assert len(small) == 64
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert "Traceback" not in (tmp_path / "scheduler.log").read_text()


def _answers(client: Client) -> bool:
    try:
        list(client.list_jobs())
    except ShoalClientError:
        return False
    return True
