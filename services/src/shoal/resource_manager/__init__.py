"""shoal.resource_manager: the inventory of hosts and devices, host liveness and the allocation
ledger (leader + standby on etcd). The pure core is :mod:`shoal.resource_manager.core`; the
replica and its gRPC handlers are in :mod:`shoal.resource_manager.service`; ``main`` runs it."""
