"""The resource-manager's WatchInventory stream, applied to the scheduler's inventory, and the
sweeps of orphan allocations and unknown learners on the agents.

Methods of :class:`~shoal.scheduler.reconcile.loop.Reconciler` (a mixin: the state lives
there)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container

import grpc

from shoal.scheduler.jobs import (
    LEAVING,
    LearnerPhase,
    LearnerRecord,
)
from shoal.scheduler.reconcile.peers import (
    FencedOutByPeer,
    describe,
)
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    resource_manager_service_pb2 as rm_pb2,
    resources_pb2,
)

log = logging.getLogger(__name__)


class InventoryWatch:
    """The inventory watch and the sweeps (part of :class:`Reconciler`)."""

    # -- inventory watch ------------------------------------------------------------------------

    async def _watch_inventory(self) -> None:
        delay = self.config.backoff_initial_s
        while True:
            call = self.peers.rm().WatchInventory(rm_pb2.WatchInventoryRequest())
            try:
                async for event in call:
                    self.on_inventory(event)
                    delay = self.config.backoff_initial_s
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and self.peers.rm_failed(exc):
                    log.info("inventory watch: following the resource-manager leader")
                    self.inventory.synced = False
                    continue
                log.info("inventory watch interrupted: %s", describe(exc))
            finally:
                call.cancel()
            self.inventory.synced = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.backoff_max_s)

    def on_inventory(self, event: rm_pb2.WatchInventoryResponse) -> None:
        """Apply one WatchInventory event and trigger a cycle."""
        kind = event.kind
        K = rm_pb2
        if kind == K.INVENTORY_EVENT_KIND_SNAPSHOT:
            self.inventory.reset(event.hosts, event.allocations)
            self._adopt_after_snapshot()
            self._last_sweep = 0.0  # look for exits missed while not watching
            self.trigger("inventory snapshot")
        elif kind == K.INVENTORY_EVENT_KIND_HOST_UP:
            for host in event.hosts:
                before = self.inventory.hosts.get(host.host_id)
                if before is not None and (before.incarnation, before.agent_address) != (
                    host.incarnation,
                    host.agent_address,
                ):
                    # The agent came back: no channel left in reconnect backoff from its outage.
                    self.peers.forget(before.agent_address)
                    self.peers.forget(host.agent_address)
                self.inventory.put_host(host)
            self.trigger(", ".join(f"host {h.host_id} up" for h in event.hosts))
        elif kind == K.INVENTORY_EVENT_KIND_HOST_LOST:
            for host in event.hosts:
                self.inventory.lose_host(host)
            # The resource-manager drops a lost host's allocations from its ledger.
            self.inventory.released(a.allocation_id for a in event.allocations)
            self.trigger(", ".join(f"host {h.host_id} lost" for h in event.hosts))
        elif kind == K.INVENTORY_EVENT_KIND_HOST_CHANGED:
            for host in event.hosts:
                self.inventory.put_host(host)
            self.trigger(", ".join(f"host {h.host_id} changed" for h in event.hosts))
        elif kind == K.INVENTORY_EVENT_KIND_ALLOCATED:
            self.inventory.allocated(event.allocations)
        elif kind == K.INVENTORY_EVENT_KIND_RELEASED:
            self.inventory.released(a.allocation_id for a in event.allocations)
            self.trigger("devices released")
        elif kind == K.INVENTORY_EVENT_KIND_LEARNER_EXITED:
            learner = event.learner
            self.exits[learner.learner_id] = learner
            self.trigger(f"learner {learner.learner_id} exited ({learner.exit_code})")

    def _adopt_after_snapshot(self) -> None:
        """After a (new) snapshot: PENDING learners of idle jobs whose allocation exists were
        acquired by a predecessor that died before writing it down: adopt them."""
        by_learner = {a.learner_id: a for a in self.inventory.ledger.values()}
        for record in self.table.records.values():
            if record.job_id in self._busy:
                continue
            for lr in record.learners.values():
                allocation = by_learner.get(lr.learner_id)
                if lr.phase is LearnerPhase.PENDING and allocation is not None:
                    lr.allocation_id = allocation.allocation_id
                    lr.host_incarnation = allocation.host_incarnation or lr.host_incarnation
                    lr.set_phase(LearnerPhase.STARTING, self.clock())
                    self.table.mark(record.job_id)  # changed in memory: observe it again

    def _release_orphans(self, known: Container[str]) -> None:
        """Free ledger allocations that no job's learner holds (a predecessor's leftovers);
        ``known``: the learner ids the jobs hold."""
        if self._orphans_busy:
            return
        orphans = self.inventory.orphans(known)
        if not orphans:
            return

        async def release() -> None:
            self._orphans_busy = True
            try:
                log.info("releasing %d orphan allocation(s): %s", len(orphans), orphans)
                await self._release(orphans)
            except FencedOutByPeer as exc:
                self._depose(str(exc))
            except Exception as exc:
                log.info("releasing orphans failed: %s", describe(exc))
            finally:
                self._orphans_busy = False

        self._spawn(release(), "scheduler-orphans")

    async def _sweep_agents(self) -> None:
        """Ask the agents about the learners we think are running: exits we missed (a watch
        gap, a fail-over) are found here."""
        by_agent: dict[str, list[LearnerRecord]] = {}
        for record in self.table.records.values():
            for lr in record.learners.values():
                if lr.phase in (LearnerPhase.RUNNING, *LEAVING) and lr.agent_address:
                    host = self.inventory.hosts.get(lr.host_id)
                    if host is not None and host.state != resources_pb2.HOST_STATE_LOST:
                        by_agent.setdefault(lr.agent_address, []).append(lr)

        async def sweep(address: str, learners: list[LearnerRecord]) -> None:
            try:
                response = await self.peers.agent(address).ListLearners(
                    ha_pb2.ListLearnersRequest(), timeout=self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                log.debug("sweep of agent %s: %s", address, describe(exc))
                return
            seen = {learner.learner_id: learner for learner in response.learners}
            now = self.clock()
            found = False
            for lr in learners:
                learner = seen.get(lr.learner_id)
                if learner is None:
                    if now - lr.phase_since > self.config.start_timeout_s:
                        self.exits.setdefault(
                            lr.learner_id,
                            resources_pb2.Learner(
                                learner_id=lr.learner_id,
                                state=resources_pb2.LEARNER_STATE_FAILED,
                                exit_code=-1,
                                exit_reason="unknown to its agent",
                            ),
                        )
                        found = True
                elif learner.state in (
                    resources_pb2.LEARNER_STATE_SUCCEEDED,
                    resources_pb2.LEARNER_STATE_FAILED,
                ):
                    self.exits.setdefault(lr.learner_id, learner)
                    found = True
            if found:
                self.trigger(f"agent {address} reported exits")

        await asyncio.gather(*(sweep(a, ls) for a, ls in by_agent.items()))
