"""One in-process parameter-sync shard on a loopback port: the test bed of the shard's gRPC tests
(test_param_sync, test_param_sync_security, test_shm_lane).

:func:`start_shard` builds the shard as its ``main`` does (torch warmed up, the servicer,
``create_server`` with the service's roles and error table, bearer tokens from a tokens file,
learner credentials verified with ``signer``'s key) on port 0; :meth:`InProcessShard.stop`
stops the server, then the servicer. What each test file does with the shard (its calls, its
jobs) stays in the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.param_sync.service import (
    ERRORS,
    ROLES,
    SERVICE_NAME,
    ParameterSyncServicer,
    ShardOptions,
    add_servicer,
)
from shoal.param_sync.shard import warm_up
from shoal.runtime.auth import LearnerTokenSigner
from shoal.runtime.config import ServerConfig
from shoal.runtime.server import RunningServer, ServiceBinding, create_server

__all__ = ["InProcessShard", "start_shard"]


@dataclass
class InProcessShard:
    """A running shard: its server (``address``) and its servicer."""

    server: RunningServer
    servicer: ParameterSyncServicer

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.servicer.close()


async def start_shard(
    tokens_file: Path,
    service_token: str,
    storage_uri: str,
    *,
    shard_index: int = 0,
    signer: LearnerTokenSigner | None = None,
    max_message_bytes: int | None = None,
    **options: Any,
) -> InProcessShard:
    """Start shard ``shard_index`` storing under ``storage_uri``, authenticating callers with
    ``tokens_file`` (and learners with ``signer``'s credentials), calling its peers with
    ``service_token``. ``options`` are further :class:`ShardOptions` (``chunk_bytes``, ...);
    ``max_message_bytes`` the server's message limit (the default's when None)."""
    warm_up()  # what the shard's main does before it serves (torch's lazy imports)
    servicer = ParameterSyncServicer(
        ShardOptions(
            shard_index=shard_index,
            storage_uri=storage_uri,
            service_token=service_token,
            **options,
        )
    )
    limits = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
    server = await create_server(
        ServerConfig("parameter-sync", tokens_file=str(tokens_file), **limits),
        [ServiceBinding(SERVICE_NAME, add_servicer, servicer, ROLES)],
        errors=ERRORS,
    )
    if signer is not None:
        assert server.credentials is not None
        server.credentials.add_learner_key(signer.public_key_raw)
    return InProcessShard(server, servicer)
