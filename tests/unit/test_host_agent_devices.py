"""Device discovery: NVML through an injected fake module (no GPU needed), the clean fallback
when pynvml or the driver is missing, simulated devices, and the real GPU when there is one."""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass

import pytest

from shoal.host_agent.devices import (
    SIMULATED_MODEL,
    NvmlDevices,
    SimulatedDevices,
    cuda_env,
    make_device_source,
    simulated_uuid,
)
from shoal.v1 import resources_pb2

HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY
UNHEALTHY = resources_pb2.DEVICE_HEALTH_UNHEALTHY


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    name: bytes | str
    uuid: str
    total: int
    util: int = 0
    temp: int = 0
    broken: bool = False  # every query fails
    broken_sampling: bool = False  # only utilization/temperature fail


def fake_nvml(gpus: list[FakeGpu], *, init_error: bool = False) -> types.SimpleNamespace:
    """A stand-in for the pynvml module with the calls the agent makes."""
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def handle(index: int) -> FakeGpu:
        gpu = gpus[index]
        if gpu.broken:
            raise FakeNVMLError(f"GPU {index} is lost")
        return gpu

    def sampled(gpu: FakeGpu) -> FakeGpu:
        if gpu.broken_sampling:
            raise FakeNVMLError("Unknown Error")
        return gpu

    return types.SimpleNamespace(
        NVMLError=FakeNVMLError,
        NVML_TEMPERATURE_GPU=0,
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: h.name,
        nvmlDeviceGetUUID=lambda h: h.uuid,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            total=h.total, used=0, free=h.total
        ),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(
            gpu=sampled(h).util, memory=0
        ),
        nvmlDeviceGetTemperature=lambda h, sensor: sampled(h).temp,
    )


def test_nvml_discovery_reads_model_memory_uuid_utilization_and_temperature():
    nvml = fake_nvml(
        [
            FakeGpu(b"NVIDIA H100 80GB HBM3", "GPU-aaaa", 80 * 2**30, util=37, temp=51),
            FakeGpu("NVIDIA H100 80GB HBM3", "GPU-bbbb", 80 * 2**30, util=0, temp=33),
        ]
    )
    source = NvmlDevices(nvml=nvml)
    assert source.available
    devices = source.discover()
    assert [(d.device_id, d.index, d.uuid) for d in devices] == [
        ("gpu0", 0, "GPU-aaaa"),
        ("gpu1", 1, "GPU-bbbb"),
    ]
    first = devices[0]
    assert first.model == "NVIDIA H100 80GB HBM3"  # bytes names are decoded
    assert first.memory_bytes == 80 * 2**30
    assert (first.utilization_percent, first.temperature_celsius) == (37.0, 51.0)
    assert first.health == HEALTHY and not first.simulated
    proto = first.to_proto()
    assert proto.uuid == "GPU-aaaa" and proto.health == HEALTHY
    source.close()
    assert nvml.calls == ["init", "shutdown"]


def test_sampling_refreshes_utilization_and_marks_failing_devices_unhealthy():
    gpus = [FakeGpu("A100", "GPU-1", 40 * 2**30, util=10), FakeGpu("A100", "GPU-2", 40 * 2**30)]
    source = NvmlDevices(nvml=fake_nvml(gpus))
    source.discover()
    gpus[0].util = 99
    gpus[1].broken_sampling = True
    sampled = source.sample()
    assert sampled[0].utilization_percent == 99.0 and sampled[0].health == HEALTHY
    assert sampled[1].health == UNHEALTHY
    gpus[1].broken_sampling = False
    assert source.sample()[1].health == HEALTHY  # it recovered


def test_a_device_that_fails_discovery_is_listed_unhealthy():
    source = NvmlDevices(
        nvml=fake_nvml([FakeGpu("A", "GPU-1", 1), FakeGpu("B", "", 1, broken=True)])
    )
    devices = source.discover()
    assert [(d.device_id, d.health) for d in devices] == [("gpu0", HEALTHY), ("gpu1", UNHEALTHY)]


def test_an_nvml_init_error_is_one_clear_log_line_and_zero_gpus(caplog):
    caplog.set_level(logging.WARNING)
    source = NvmlDevices(nvml=fake_nvml([FakeGpu("A", "GPU-1", 1)], init_error=True))
    assert not source.available
    assert source.discover() == [] and source.sample() == []
    source.close()
    (record,) = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert "NVML could not be initialized" in record.getMessage()
    assert "0 GPUs" in record.getMessage()


def test_without_pynvml_installed_there_are_zero_gpus_and_no_crash(monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    source = NvmlDevices()
    assert source.discover() == []
    assert any("pynvml is not installed" in r.getMessage() for r in caplog.records)


def test_simulated_devices_have_deterministic_uuids_per_host_and_index():
    a = SimulatedDevices("h1", 4).discover()
    again = SimulatedDevices("h1", 4).discover()
    other = SimulatedDevices("h2", 4).discover()
    assert [d.device_id for d in a] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert [d.uuid for d in a] == [d.uuid for d in again]
    assert not {d.uuid for d in a} & {d.uuid for d in other}
    assert a[2].uuid == simulated_uuid("h1", 2) and a[2].uuid.startswith("GPU-")
    assert all(d.simulated and d.model == SIMULATED_MODEL and d.health == HEALTHY for d in a)
    assert SimulatedDevices("h1", 0).discover() == []


def test_learners_on_simulated_devices_see_no_gpu_and_real_ones_see_theirs():
    sim = SimulatedDevices("h1", 2).discover()[1]
    assert cuda_env(sim) == {"CUDA_VISIBLE_DEVICES": ""}
    real = NvmlDevices(nvml=fake_nvml([FakeGpu("A", "G0", 1), FakeGpu("B", "G1", 1)])).discover()[1]
    assert cuda_env(real) == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_simulate_flag_selects_simulated_devices():
    assert isinstance(make_device_source("h1", 3), SimulatedDevices)
    assert isinstance(make_device_source("h1", 0), SimulatedDevices)


@pytest.mark.gpu
def test_real_gpus_are_discovered_through_nvml():
    pynvml = pytest.importorskip("pynvml", reason="pynvml (nvidia-ml-py) is not installed")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVIDIA driver: {exc}")
    if count == 0:
        pytest.skip("no NVIDIA GPU")
    source = NvmlDevices()
    devices = source.discover()
    try:
        assert len(devices) == count
        for i, dev in enumerate(devices):
            assert dev.device_id == f"gpu{i}" and dev.index == i
            assert dev.uuid.startswith("GPU-") and dev.model and dev.memory_bytes > 2**30
            assert dev.health == HEALTHY and not dev.simulated
            assert 0 <= dev.utilization_percent <= 100 and dev.temperature_celsius > 0
    finally:
        source.close()
