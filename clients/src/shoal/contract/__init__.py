"""The contract every shoal process shares: what crosses a process boundary besides the protos.

This package imports neither grpc nor torch (a test checks it), so that a client, a learner
and every service may import it without pulling the other side's dependencies. One module per
part of the contract:

* ``ids`` -- the patterns of identifiers that become paths or keys (job, learner, host,
  artifact, checkpoint ids), and their validation.

Planned here (issue 15): the etcd key schema, the learner environment variable names, the
error-reason trailer and the tensor wire codec.
"""
