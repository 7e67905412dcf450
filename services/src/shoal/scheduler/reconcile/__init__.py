"""The scheduler's control loop, one module per part (the names are re-exported here).

* ``loop`` -- :class:`Reconciler`: the leadership term, the triggers, the cycle.
* ``workers``, ``lifecycle``, ``watch`` -- the rest of :class:`Reconciler`, as mixins: the I/O
  of one job's worker; a job's progress, health and end; the inventory watch and the sweeps.
* ``decide`` -- the cycle's observing and deciding, pure functions: records in, decisions out.
* ``config`` -- :class:`ReconcileConfig` and the election name.
* ``rules`` -- pure rules: a job's coordinator shard, its sync mode, a learner's environment.
* ``work`` -- :class:`JobWork`, what one worker run does for one job.
* ``peers`` -- :class:`Peers`, the channel pool to the resource-manager, the agents and the
  shards, with the outbound error table (transient codes, fenced by a peer).
* ``inventory`` -- :class:`Inventory`, the resource-manager's view from WatchInventory.
* ``registry`` -- the shard registry and the coordinator moves the parameter-sync tier keeps in
  etcd.

See ``loop`` for what a cycle does.
"""

from shoal.scheduler.reconcile.config import ELECTION, ReconcileConfig
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.reconcile.loop import Reconciler
from shoal.scheduler.reconcile.peers import (
    TRANSIENT_CODES,
    FencedOutByPeer,
    Peers,
    PermanentFailure,
)
from shoal.scheduler.reconcile.registry import (
    SHARD_REGISTRY,
    CoordinatorMoves,
    ShardRegistry,
    follow_prefix,
    migrate_legacy_moves,
)
from shoal.scheduler.reconcile.rules import (
    SYNC_BACKENDS,
    coordinator_index,
    learner_env,
    resolve_sync_mode,
)
from shoal.scheduler.reconcile.work import JobWork

__all__ = [
    "ELECTION",
    "SHARD_REGISTRY",
    "SYNC_BACKENDS",
    "TRANSIENT_CODES",
    "CoordinatorMoves",
    "FencedOutByPeer",
    "Inventory",
    "JobWork",
    "Peers",
    "PermanentFailure",
    "ReconcileConfig",
    "Reconciler",
    "ShardRegistry",
    "coordinator_index",
    "follow_prefix",
    "learner_env",
    "migrate_legacy_moves",
    "resolve_sync_mode",
]
