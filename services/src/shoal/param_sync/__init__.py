"""shoal.param_sync: the parameter-sync service, the data plane of shoal jobs.

One process is one shard (``shoal-service parameter-sync --shard-index I ...``). For each job
one shard is the coordinator (membership generations, iteration boundaries, the two-phase
commit of every iteration, progress, checkpoints); every shard holds a slice of the job's
tensors, sums the gradients the learners stream to it and runs the job's optimizer.

* :mod:`~shoal.param_sync.coordinator`: the pure coordinator core;
* :mod:`~shoal.param_sync.sharding`: whole tensors onto shards, balanced by bytes;
* :mod:`~shoal.param_sync.shard`: one shard's slice of a job (sums, optimizer, files);
* :mod:`~shoal.param_sync.checkpoint`: the storage layout and crash-safe writes;
* :mod:`~shoal.param_sync.service`: the gRPC servicer;
* :mod:`~shoal.param_sync.main`: flags, etcd registration, the process.

See docs/data-plane.md.
"""
