"""shoal.runtime: what every shoal service stands on (bootstrap, config, auth, errors, telemetry,
the etcd state store and leader election)."""
