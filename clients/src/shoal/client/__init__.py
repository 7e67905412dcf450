"""shoal.client: the typed Python client of shoal (sync ``Client`` and asyncio ``AsyncClient``).

from shoal.client import Client, load_config
with Client(load_config()) as client:
    artifact = client.upload_directory("my_model/")
    job = client.submit_job(JobSpec(name="digits", entry_point="train.py", ...))
"""

from shoal.client._async import AsyncClient, pack_directory
from shoal.client._sync import Client
from shoal.client.config import ClientConfig, ConfigError, load_config
from shoal.client.errors import ShoalClientError

__all__ = [
    "AsyncClient",
    "Client",
    "ClientConfig",
    "ConfigError",
    "ShoalClientError",
    "load_config",
    "pack_directory",
]
