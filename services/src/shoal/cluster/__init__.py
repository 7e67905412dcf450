"""shoal.cluster: the embedded local cluster (etcd and every service on this machine)."""
