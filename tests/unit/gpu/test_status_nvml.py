"""GPU status decoding, and the real NVML backend driven through a stub pynvml module."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from dynamo_ftctl.errors import ExitCode, MissingExtra, Unreachable
from dynamo_ftctl.gpu.fake import FakeGpu, FakeNvml
from dynamo_ftctl.gpu.nvml import PynvmlBackend, open_nvml
from dynamo_ftctl.gpu.status import decode_throttle, read_status, throttle_groups


def test_decode_throttle_names_and_groups() -> None:
    """Bits decode to NVML's reasons and to the thermal/power/HW-slowdown groups."""
    reasons = decode_throttle(0x4 | 0x8 | 0x40 | 0x1000)
    assert reasons == ("sw_power_cap", "hw_slowdown", "hw_thermal", "bit_0x1000")
    assert throttle_groups(reasons) == ("thermal", "power", "hw_slowdown")
    assert decode_throttle(0) == ()
    assert decode_throttle(None) == ()


def test_status_lists_problems_and_health() -> None:
    """ECC, remap and throttle problems make a GPU (and the report) unhealthy."""
    gpus = [
        FakeGpu(0),
        FakeGpu(1, ecc_volatile_uncorrected=2, remap_pending=True, throttle_mask=0x40,
                nvlink=(True, False)),
        FakeGpu(2, throttle_mask=0x4),  # software power cap alone is normal under load
    ]
    report = read_status(FakeNvml(gpus))
    assert [g.healthy for g in report.gpus] == [True, False, True]
    assert not report.healthy
    doc = report.to_json()
    bad = doc["gpus"][1]
    assert bad["throttle"] == ["thermal", "hw_slowdown"]
    assert bad["nvlink"] == {"links": 2, "up": 1, "down": [1]}
    assert len(bad["problems"]) == 4
    for key in ("name", "uuid", "pci_bus_id", "util_gpu", "memory_used", "memory_total",
                "temperature_c", "power_w", "ecc_volatile_uncorrected",
                "ecc_aggregate_uncorrected", "remap_pending", "remap_failure"):
        assert key in bad


def test_status_renders_for_people() -> None:
    """The report renders as a rich table."""
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(read_status(FakeNvml(2)))
    text = console.export_text()
    assert "GPU status" in text
    assert "H100" in text


class _NVMLError(Exception):
    pass


def _stub(**overrides: Any) -> types.SimpleNamespace:
    """A pynvml stand-in: one H100 whose calls return fixed values."""

    class NotSupported(_NVMLError):
        pass

    class LibraryNotFound(_NVMLError):
        pass

    class DriverNotLoaded(_NVMLError):
        pass

    class GpuIsLost(_NVMLError):
        pass

    class Timeout(_NVMLError):
        pass

    def not_supported(*_: Any) -> Any:
        raise NotSupported

    def nvlink_state(_: Any, link: int) -> int:
        if link >= 4:
            raise NotSupported
        return 0 if link == 3 else 1

    nv = types.SimpleNamespace(
        NVMLError=_NVMLError, NVMLError_NotSupported=NotSupported,
        NVMLError_LibraryNotFound=LibraryNotFound, NVMLError_DriverNotLoaded=DriverNotLoaded,
        NVMLError_GpuIsLost=GpuIsLost, NVMLError_Timeout=Timeout,
        NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        NVML_AGGREGATE_ECC=1, NVML_NVLINK_MAX_LINKS=18, nvmlEventTypeXidCriticalError=8,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetIndex=lambda h: int(h[1:]),
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetUUID=lambda h: "GPU-abc",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=b"00000000:3B:00.0"),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=10, total=80),
        nvmlDeviceGetTemperature=lambda h, sensor: 71,
        nvmlDeviceGetPowerUsage=lambda h: 650_000,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 5 if counter else 1,
        nvmlDeviceGetRemappedRows=lambda h: (0, 1, 1, 0),
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x40,
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlEventSetCreate=lambda: "set",
        nvmlEventSetFree=lambda s: None,
        nvmlDeviceRegisterEvents=lambda h, kinds, s: None,
        nvmlEventSetWait_v2=lambda s, ms: types.SimpleNamespace(
            device="h0", eventType=8, eventData=48, gpuInstanceId=0xFFFFFFFF,
            computeInstanceId=0xFFFFFFFF,
        ),
        not_supported=not_supported,
    )
    for key, value in overrides.items():
        setattr(nv, key, value)
    return nv


def test_real_backend_reads_every_field() -> None:
    """PynvmlBackend turns NVML's answers into a snapshot (units converted)."""
    snap = PynvmlBackend(_stub()).snapshot(0)
    assert snap.name == "NVIDIA H100 80GB HBM3"
    assert snap.pci_bus_id == "00000000:3B:00.0"
    assert (snap.util_gpu, snap.util_memory, snap.temperature_c) == (97, 40, 71)
    assert (snap.power_w, snap.power_limit_w) == (650.0, 700.0)
    assert (snap.ecc_volatile_uncorrected, snap.ecc_aggregate_uncorrected) == (1, 5)
    assert (snap.remap_pending, snap.remap_failure, snap.remapped_rows_uncorrectable) == (
        True, False, 1)
    assert snap.throttle_mask == 0x40
    assert snap.nvlink == (True, True, True, False)


def test_real_backend_unsupported_fields_are_none() -> None:
    """A reading the GPU does not support is None, not an error."""
    nv = _stub()
    nv.nvmlDeviceGetRemappedRows = nv.not_supported
    nv.nvmlDeviceGetTotalEccErrors = nv.not_supported
    nv.nvmlDeviceGetNvLinkState = nv.not_supported
    snap = PynvmlBackend(nv).snapshot(0)
    assert snap.remap_pending is None
    assert snap.ecc_volatile_uncorrected is None
    assert snap.nvlink == ()


def test_real_backend_waits_for_xid_events() -> None:
    """Xid events come from the event set; a timeout is None."""
    nv = _stub()
    backend = PynvmlBackend(nv)
    signal = backend.wait_xid(100)
    assert signal is not None
    assert (signal.index, signal.xid, signal.gpu_instance) == (0, 48, None)

    def timeout(*_: Any) -> Any:
        raise nv.NVMLError_Timeout

    nv.nvmlEventSetWait_v2 = timeout
    assert backend.wait_xid(100) is None
    backend.close()
    backend.close()


def test_lost_gpu_and_missing_driver_are_unreachable() -> None:
    """GpuIsLost mid-read and DriverNotLoaded at init become Unreachable (exit 3)."""
    nv = _stub()

    def lost(*_: Any) -> Any:
        raise nv.NVMLError_GpuIsLost

    nv.nvmlDeviceGetPowerUsage = lost
    with pytest.raises(Unreachable, match="lost"):
        PynvmlBackend(nv).snapshot(0)


def test_open_nvml_without_a_driver_is_unreachable() -> None:
    """On a host without the NVIDIA driver, open_nvml raises Unreachable with exit 3."""
    if _nvml_works():
        pytest.skip("an NVIDIA driver is present on this host")
    with pytest.raises(Unreachable, match=r"NVML|driver") as caught:
        open_nvml()
    assert caught.value.exit_code == ExitCode.UNREACHABLE


def test_open_nvml_without_pynvml_names_the_gpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the gpu extra's pynvml, open_nvml raises MissingExtra (exit 2, the hint)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` then fails
    with pytest.raises(MissingExtra, match=r"pip install 'dynamo-ftctl\[gpu\]'") as caught:
        open_nvml()
    assert caught.value.exit_code == ExitCode.USAGE


def _nvml_works() -> bool:
    try:
        open_nvml().close()
    except Unreachable:
        return False
    return True
