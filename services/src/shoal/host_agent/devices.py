"""Device discovery and sampling: NVIDIA GPUs through NVML, or simulated GPUs.

:class:`NvmlDevices` reads the GPUs with ``pynvml`` (the ``nvidia-ml-py`` package, the
``shoal-services[gpu]`` extra). It is optional: without the package, or without an NVIDIA
driver, discovery logs one clear line and finds zero GPUs; it never crashes the agent. Each GPU
is ``gpu<index>`` with its NVML index, UUID, model name, memory, utilization and temperature; an
NVML error on one device marks that device UNHEALTHY (it stays listed). The NVML module can be
injected (``NvmlDevices(nvml=fake)``) so discovery is tested without a GPU.

:class:`SimulatedDevices` (``host-agent --simulate-gpus N``) exposes N devices flagged
``simulated`` with deterministic UUIDs derived from the host id and the index, so a CPU machine
can run the whole platform; learners on them run on the CPU (CUDA_VISIBLE_DEVICES="").

NVML numbers devices by PCI bus id; the agent starts learners with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA's index matches (see :func:`cuda_env`).
"""

from __future__ import annotations

import logging
import types
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shoal.v1 import resources_pb2

__all__ = [
    "SIMULATED_MEMORY_BYTES",
    "SIMULATED_MODEL",
    "DeviceInfo",
    "DeviceSource",
    "NvmlDevices",
    "SimulatedDevices",
    "cuda_env",
    "make_device_source",
    "simulated_uuid",
]

log = logging.getLogger(__name__)

HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY
UNHEALTHY = resources_pb2.DEVICE_HEALTH_UNHEALTHY

SIMULATED_MODEL = "shoal simulated GPU"
SIMULATED_MEMORY_BYTES = 16 * 1024**3
_SIMULATED_NAMESPACE = uuid.UUID("5b0a1d0e-53a1-4c2e-9f1e-5e7d0d0a1c01")


@dataclass(frozen=True)
class DeviceInfo:
    """One device of this host as last discovered or sampled."""

    device_id: str
    index: int
    uuid: str
    model: str
    memory_bytes: int
    health: resources_pb2.DeviceHealth.ValueType = HEALTHY
    simulated: bool = False
    utilization_percent: float = 0.0
    temperature_celsius: float = 0.0

    def to_proto(self) -> resources_pb2.Device:
        return resources_pb2.Device(
            device_id=self.device_id,
            index=self.index,
            uuid=self.uuid,
            model=self.model,
            memory_bytes=self.memory_bytes,
            health=self.health,
            simulated=self.simulated,
            utilization_percent=self.utilization_percent,
            temperature_celsius=self.temperature_celsius,
        )


def cuda_env(device: DeviceInfo) -> dict[str, str]:
    """The environment that pins a learner to ``device`` (none at all for simulated ones)."""
    if device.simulated:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": str(device.index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class DeviceSource(ABC):
    """Where a host's devices come from."""

    @abstractmethod
    def discover(self) -> list[DeviceInfo]:
        """The devices, with static facts and a first sample."""

    @abstractmethod
    def sample(self) -> list[DeviceInfo]:
        """The devices with fresh utilization, temperature and health."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the driver (if any)."""


def simulated_uuid(host_id: str, index: int) -> str:
    """A deterministic GPU-style UUID for simulated device ``index`` of ``host_id``."""
    return f"GPU-{uuid.uuid5(_SIMULATED_NAMESPACE, f'{host_id}/{index}')}"


class SimulatedDevices(DeviceSource):
    """``count`` simulated GPUs (``gpu0`` ...); learners on them run on the CPU."""

    def __init__(self, host_id: str, count: int) -> None:
        if count < 0:
            raise ValueError(f"count ({count}) must be >= 0")
        self._devices = [
            DeviceInfo(
                device_id=f"gpu{i}",
                index=i,
                uuid=simulated_uuid(host_id, i),
                model=SIMULATED_MODEL,
                memory_bytes=SIMULATED_MEMORY_BYTES,
                simulated=True,
            )
            for i in range(count)
        ]

    def discover(self) -> list[DeviceInfo]:
        return list(self._devices)

    def sample(self) -> list[DeviceInfo]:
        return list(self._devices)


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlDevices(DeviceSource):
    """NVIDIA GPUs through NVML. ``nvml``: the ``pynvml`` module (imported when None)."""

    def __init__(self, nvml: types.ModuleType | object | None = None) -> None:
        self._nvml: object | None = None
        self._ready = False
        self._static: list[DeviceInfo] = []
        if nvml is None:
            try:
                import pynvml  # type: ignore[import-not-found,unused-ignore]
            except ImportError:
                log.warning(
                    "GPU discovery: pynvml is not installed (pip install nvidia-ml-py, or "
                    "shoal-services[gpu]); this host offers 0 GPUs"
                )
                return
            nvml = pynvml
        self._nvml = nvml
        error = getattr(nvml, "NVMLError", Exception)
        try:
            nvml.nvmlInit()  # type: ignore[union-attr]
        except error as exc:
            log.warning(
                "GPU discovery: NVML could not be initialized (%s: %s); no NVIDIA driver? "
                "This host offers 0 GPUs",
                type(exc).__name__,
                exc,
            )
            return
        except OSError as exc:  # a missing or broken libnvidia-ml
            log.warning("GPU discovery: NVML library could not be loaded (%s); 0 GPUs", exc)
            return
        self._ready = True

    @property
    def available(self) -> bool:
        """Whether NVML is initialized."""
        return self._ready

    def _error_type(self) -> type[BaseException]:
        error = getattr(self._nvml, "NVMLError", Exception)
        return error if isinstance(error, type) else Exception

    def discover(self) -> list[DeviceInfo]:
        if not self._ready:
            return []
        nvml: object = self._nvml
        error = self._error_type()
        try:
            count = int(nvml.nvmlDeviceGetCount())  # type: ignore[attr-defined]
        except error as exc:
            log.warning("GPU discovery: nvmlDeviceGetCount failed (%s); 0 GPUs", exc)
            return []
        devices: list[DeviceInfo] = []
        for index in range(count):
            device_id = f"gpu{index}"
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)  # type: ignore[attr-defined]
                name = _text(nvml.nvmlDeviceGetName(handle))  # type: ignore[attr-defined]
                uuid_text = _text(nvml.nvmlDeviceGetUUID(handle))  # type: ignore[attr-defined]
                memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)  # type: ignore[attr-defined]
            except error as exc:
                log.warning("GPU discovery: device %d failed (%s); marked unhealthy", index, exc)
                devices.append(DeviceInfo(device_id, index, "", "", 0, UNHEALTHY))
                continue
            devices.append(DeviceInfo(device_id, index, uuid_text, name, memory))
        self._static = devices
        log.info(
            "GPU discovery: %d NVIDIA GPU(s): %s",
            len(devices),
            ", ".join(f"{d.device_id}={d.model}" for d in devices) or "none",
        )
        return self.sample()

    def sample(self) -> list[DeviceInfo]:
        if not self._ready:
            return []
        nvml: object = self._nvml
        error = self._error_type()
        out: list[DeviceInfo] = []
        for dev in self._static:
            if not dev.uuid:
                out.append(dev)
                continue
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(dev.index)  # type: ignore[attr-defined]
                util = nvml.nvmlDeviceGetUtilizationRates(handle)  # type: ignore[attr-defined]
                sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
                temp = nvml.nvmlDeviceGetTemperature(handle, sensor)  # type: ignore[attr-defined]
            except error as exc:
                log.warning("GPU %s: sampling failed (%s); marked unhealthy", dev.device_id, exc)
                out.append(replace(dev, health=UNHEALTHY))
                continue
            out.append(
                replace(
                    dev,
                    health=HEALTHY,
                    utilization_percent=float(util.gpu),
                    temperature_celsius=float(temp),
                )
            )
        return out

    def close(self) -> None:
        if self._ready:
            try:
                self._nvml.nvmlShutdown()  # type: ignore[union-attr]
            except Exception as exc:  # best effort at exit
                log.debug("nvmlShutdown failed: %s", exc)
            self._ready = False


def make_device_source(host_id: str, simulate_gpus: int | None) -> DeviceSource:
    """Simulated devices when ``simulate_gpus`` is set (even 0), else NVML."""
    if simulate_gpus is not None:
        return SimulatedDevices(host_id, simulate_gpus)
    return NvmlDevices()


def find(devices: Sequence[DeviceInfo], device_id: str) -> DeviceInfo | None:
    return next((d for d in devices if d.device_id == device_id), None)
