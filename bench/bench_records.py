"""Appending a job's records on an object store: the cost of one append as the job's records
grow, and of reading them whole (what GetJobMetrics and a takeover do).

The coordinator appends to ``metrics/iterations.jsonl`` at every commit (collective mode: every
iteration) through ``shoal.param_sync.checkpoint.append_line``. Here against a real
S3-compatible server (moto's server mode, a process on loopback started by the bench): a file
of ``N`` records is put first (as a job's earlier records), then ``--appends`` appends are
timed one by one (each the coordinator's append of one record, compactions included), then a
whole read. Old code appended by reading the object and putting it again (read-modify-write);
new code puts an object per append (``shoal.contract.records``). Run each tree in turn:

    PYTHONPATH=<tree>/clients/src:<tree>/services/src .venv/bin/python bench/bench_records.py

Reports per N: mean and median ms per append, and ms for one whole read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

BUCKET = "bench-records"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record(i: int) -> str:
    return json.dumps(
        {
            "global_iteration": i,
            "epoch": i // 100,
            "iteration": i % 100,
            "generation": 3,
            "world_size": 4,
            "loss": 0.5 / (i + 1),
            "samples": 256,
            "samples_per_second": 12345.6,
            "time": 1.7e9 + i,
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, nargs="+", default=[1000, 10000, 30000])
    parser.add_argument("--appends", type=int, default=100)
    args = parser.parse_args()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto did not start") from None
                time.sleep(0.1)
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
        )
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        from shoal.param_sync import checkpoint as ckpt

        read = getattr(ckpt, "read_records", ckpt.read_bytes)  # (old code: one object)
        print(
            f"# {time.strftime('%Y-%m-%d %H:%M')}, moto server on loopback, {args.appends} appends"
        )
        print("| records before | MB before | ms per append: mean / median | whole read (ms) |")
        print("|---|---|---|---|")
        for n in args.records:
            uri = ckpt.job_uri(f"s3://{BUCKET}", f"job-{n}", "metrics", "iterations.jsonl")
            body = "".join(record(i) + "\n" for i in range(n)).encode()
            ckpt.atomic_write(uri, body)
            times = []
            for i in range(n, n + args.appends):
                began = time.perf_counter()
                ckpt.append_line(uri, record(i))
                times.append(time.perf_counter() - began)
            began = time.perf_counter()
            data = read(uri)
            reading = time.perf_counter() - began
            lines = (data or b"").decode().splitlines()
            assert [json.loads(x)["global_iteration"] for x in lines] == list(
                range(n + args.appends)
            )
            print(
                f"| {n} | {len(body) / 1e6:.2f} | {statistics.mean(times) * 1e3:.1f} / "
                f"{statistics.median(times) * 1e3:.1f} | {reading * 1e3:.0f} |",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
