"""The contract every shoal process shares: what crosses a process boundary besides the protos.

This package imports neither grpc nor torch (a test checks it), so that a client, a learner
and every service may import it without pulling the other side's dependencies. One module per
part of the contract:

* ``ids`` -- the patterns of identifiers that become paths or keys (job, learner, host,
  artifact, checkpoint ids), and their validation.
* ``data_plane`` -- the parameter-sync tier's etcd keys (shard registrations, a job's moved
  coordinator) and the coordinator record's codec (protobuf; legacy JSON read).
* ``wire`` -- the tensor-bundle wire codec of the gradient and parameter streams (learner and
  shard both speak it).
* ``user_metrics`` -- the names a training script may log (``trainer.log``), checked by the
  learner and by the coordinator.
* ``errors`` -- every domain error, once (standard library only), the error trailers
  (``shoal-error-reason``, ``shoal-leader``) and ``decode_rpc_error``, their one decoder.
* ``keys`` -- the etcd key schema: every prefix under ``/shoal/v1/`` (elections, auth, the
  scheduler's and the resource manager's state, shard registrations, moved coordinators).
* ``environment`` -- the names of the ``SHOAL_*`` variables a learner is given and reads.
* ``faults`` -- the test fault points (``SHOAL_TEST_FAULT``) of the shards and the learners.
* ``files`` -- the atomic write of a file at a storage URI (checkpoint files of shards and of
  collective learners).
* ``stored`` -- the encoding of records kept in etcd (protobuf; the JSON of earlier releases
  told apart by its first byte).
* ``processes`` -- whether a recorded pid is still alive (the lane's sweep, ``shoal cluster``).
* ``batch_schedule`` -- the sample positions of a job whose global batch changes (the opt-in
  adaptive batch) and the learning-rate rules that follow the batch.
"""
