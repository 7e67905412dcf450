"""What authentication, identifier checks and mutual TLS cost.

    .venv/bin/python bench/bench_auth.py                # both parts
    .venv/bin/python bench/bench_auth.py --rounds 10 --mib 44.6

Part 1, per call, in process (``timeit``, best of 5): ``Credentials.authenticate`` of an opaque
token (a sha256 and a dict lookup) and of a learner credential (an Ed25519 JWT verified with
PyJWT the first time, then remembered until it expires or its key changes), and
``check_request_ids`` of a BoundaryRequest and of an AcquireDevicesRequest with 8 claims (what
the interceptor adds to every call).

Part 2, the hot path: one "sync round" of the gradient stream's shape through the real server
bootstrap (``create_server``, auth on) in another process: the client streams ``--mib`` MiB in
4 MiB messages and the server streams the same amount back, plaintext vs mutual TLS (P-256
certificates from ``shoal.runtime.pki``). Median and min of ``--rounds`` rounds after 2 warm-up
rounds, both variants interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

CHUNK = 4 * 1024 * 1024

SERVER = r"""
import asyncio, sys
import grpc
from shoal.runtime.auth import MethodRoles, SERVICES
from shoal.runtime.config import ServerConfig, TLSConfig
from shoal.runtime.server import ServiceBinding, create_server

CHUNK = 4 * 1024 * 1024
tokens, tls_dir = sys.argv[1], sys.argv[2]

class Echo:
    async def Round(self, requests, context):
        total = 0
        async for message in requests:
            total += len(message)
        sent = 0
        block = bytes(CHUNK)
        while sent < total:
            n = min(CHUNK, total - sent)
            yield block[:n]
            sent += n

def add(servicer, server):
    handler = grpc.stream_stream_rpc_method_handler(servicer.Round)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Round": handler}),)
    )

async def main():
    tls = None
    if tls_dir != "-":
        tls = TLSConfig(f"{tls_dir}/service-bench.pem", f"{tls_dir}/service-bench-key.pem",
                        f"{tls_dir}/ca.pem")
    config = ServerConfig("bench", tokens_file=tokens, tls=tls, max_message_bytes=64 << 20)
    running = await create_server(
        config, [ServiceBinding("bench.Echo", add, Echo(), MethodRoles("bench.Echo", SERVICES))]
    )
    print(f"LISTENING {running.port}", flush=True)
    await running.server.wait_for_termination()

asyncio.run(main())
"""


def part1() -> list[str]:
    from shoal.runtime.auth import Credentials, LearnerTokenSigner, Role, new_token
    from shoal.runtime.validation import check_request_ids
    from shoal.v1 import parameter_sync_service_pb2 as ps, resource_manager_service_pb2 as rm

    with tempfile.TemporaryDirectory() as tmp:
        from shoal.runtime.auth import write_tokens_file

        token = new_token()
        write_tokens_file(Path(tmp) / "tokens", [(token, "alice", Role.USER)])
        signer = LearnerTokenSigner.generate()
        creds = Credentials(tokens_file=Path(tmp) / "tokens", learner_keys=[signer.public_key_raw])
        jwt = signer.mint(job_id="job-4f1c2a9b03de", learner_id="job-4f1c2a9b03de-l7")
        boundary = ps.BoundaryRequest(job_id="job-4f1c2a9b03de", learner_id="job-4f1c2a9b03de-l7")
        acquire = rm.AcquireDevicesRequest(
            claims=[
                rm.DeviceClaim(
                    job_id="job-1", learner_id=f"job-1-l{i}", host_id="h1", device_id=f"gpu{i}"
                )
                for i in range(8)
            ]
        )
        cases = {
            "authenticate an opaque token": lambda: creds.authenticate(token),
            "authenticate a learner credential, first call (Ed25519 JWT verified)": lambda: (
                creds._learners._cache.clear(),
                creds.authenticate(jwt),
            ),
            "authenticate a learner credential, later calls (cached)": lambda: creds.authenticate(
                jwt
            ),
            "check_request_ids(BoundaryRequest)": lambda: check_request_ids(boundary),
            "check_request_ids(AcquireDevicesRequest, 8 claims)": lambda: check_request_ids(
                acquire
            ),
        }
        out = []
        for name, fn in cases.items():
            n = 2000
            best = min(timeit.repeat(fn, number=n, repeat=5)) / n
            out.append(f"| {name} | {best * 1e6:.1f} us |")
        return out


async def one_round(channel, nbytes: int, token: str) -> float:
    call = channel.stream_stream("/bench.Echo/Round")
    block = bytes(CHUNK)

    async def requests():
        sent = 0
        while sent < nbytes:
            n = min(CHUNK, nbytes - sent)
            yield block[:n]
            sent += n

    started = time.perf_counter()
    got = 0
    async for message in call(requests(), metadata=(("authorization", f"Bearer {token}"),)):
        got += len(message)
    assert got == nbytes
    return time.perf_counter() - started


def start_servers(tmp: Path) -> tuple[str, dict[str, subprocess.Popen[str]], dict[str, int]]:
    """A token, and the plaintext and mutual-TLS echo servers (processes and ports)."""
    from shoal.runtime.auth import Role, new_token, write_tokens_file
    from shoal.runtime.pki import CertificateAuthority

    token = new_token()
    write_tokens_file(tmp / "tokens", [(token, "bench", Role.SERVICE)])
    ca = CertificateAuthority.create(tmp / "tls")
    ca.issue("service", "bench")
    ca.issue("service", "client")
    procs, ports = {}, {}
    for variant, tls_dir in (("plaintext", "-"), ("mutual TLS", str(tmp / "tls"))):
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(tmp / "tokens"), tls_dir],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
        )
        assert proc.stdout is not None
        ports[variant] = int(proc.stdout.readline().split()[1])
        procs[variant] = proc
    return token, procs, ports


async def part2(tmp: Path, token: str, ports: dict[str, int], rounds: int, mib: float) -> list[str]:
    from grpc import aio

    from shoal.client.tls import channel_credentials

    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    channels = {
        "plaintext": aio.insecure_channel(f"127.0.0.1:{ports['plaintext']}", options=options),
        "mutual TLS": aio.secure_channel(
            f"127.0.0.1:{ports['mutual TLS']}",
            channel_credentials(
                str(tmp / "tls" / "ca.pem"),
                str(tmp / "tls" / "service-client.pem"),
                str(tmp / "tls" / "service-client-key.pem"),
            ),
            options=options,
        ),
    }
    nbytes = int(mib * 1024 * 1024)
    times: dict[str, list[float]] = {v: [] for v in channels}
    try:
        for i in range(rounds + 2):
            for variant, channel in channels.items():
                t = await one_round(channel, nbytes, token)
                if i >= 2:
                    times[variant].append(t)
    finally:
        for channel in channels.values():
            await channel.close()
    base = statistics.median(times["plaintext"])
    out = []
    for variant, ts in times.items():
        med = statistics.median(ts)
        out.append(
            f"| {variant} | {med * 1e3:.0f} ms (min {min(ts) * 1e3:.0f}) | {med / base:.2f}x |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mib", type=float, default=44.6, help="MiB each way per round")
    ns = parser.parse_args()
    print("| per call | best of 5 |\n|---|---|")
    print("\n".join(part1()))
    print(f"\n| one round, {ns.mib} MiB each way | median | vs plaintext |\n|---|---|---|")
    tmp = Path(tempfile.mkdtemp(prefix="bench-auth-"))
    token, procs, ports = start_servers(tmp)
    try:
        print("\n".join(asyncio.run(part2(tmp, token, ports, ns.rounds, ns.mib))))
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
