"""A leader-election contender, run as a subprocess by test_election.py.

Campaigns in ``--name`` on the etcd at ``--endpoints``; prints one line per step (flushed):

    CAMPAIGNING <id>
    LEADER <id> <create_revision>       it leads (the fence's create_revision)
    WRITE OK <revision> | WRITE FENCED | WRITE ERROR <type>
                                        a fenced write of <id> to --key, every --interval s,
                                        each preceded by Leadership.check()
    LOST <id> <reason>                  check() raised LeadershipLost: it stops writing
    PROBE FENCED | PROBE OK <revision> | PROBE ERROR <type>
                                        one more fenced write that ignores check(), as a buggy
                                        leader would: fencing must refuse it
    EXIT
"""

from __future__ import annotations

import argparse
import asyncio

from shoal.runtime.election import LeaderElection, LeadershipLost
from shoal.runtime.store import EtcdStore, FencedOut, StoreError


def say(*parts: object) -> None:
    print(*parts, flush=True)


async def contend(args: argparse.Namespace) -> None:
    store = EtcdStore(args.endpoints.split(","), timeout=1.0)
    election = LeaderElection(store, args.name, args.id, ttl=args.ttl)
    say("CAMPAIGNING", args.id)
    leadership = await election.campaign()
    say("LEADER", args.id, leadership.fence.create_revision)
    try:
        while True:
            try:
                leadership.check()
            except LeadershipLost as exc:
                say("LOST", args.id, exc)
                break
            try:
                revision = await store.put(args.key, args.id.encode(), fence=leadership.fence)
                say("WRITE OK", revision)
            except FencedOut:
                say("WRITE FENCED")
            except StoreError as exc:
                say("WRITE ERROR", type(exc).__name__)
            await asyncio.sleep(args.interval)
        try:
            revision = await store.put(
                args.key, f"stale {args.id}".encode(), fence=leadership.fence
            )
            say("PROBE OK", revision)
        except FencedOut:
            say("PROBE FENCED")
        except StoreError as exc:
            say("PROBE ERROR", type(exc).__name__)
    finally:
        await leadership.resign()
        await store.close()
    say("EXIT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoints", required=True, help="comma-separated host:port")
    parser.add_argument("--name", required=True, help="election name")
    parser.add_argument("--id", required=True, help="candidate id")
    parser.add_argument("--key", required=True, help="key the leader writes")
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.1)
    asyncio.run(contend(parser.parse_args()))


if __name__ == "__main__":
    main()
