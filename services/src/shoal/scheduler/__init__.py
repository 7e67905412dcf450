"""The job-scheduler: share policy, device placement and the trace-replay simulator (pure core)."""
