"""The one seam to NVML: a small interface, the real `pynvml` backend, PCI id rules.

Everything ftctl reads from a GPU passes through `NvmlBackend`: a device count,
one raw `GpuSnapshot` per device, and a wait for Xid critical-error events.
Decoding (throttle reasons, health verdicts) and change detection live above
it (`gpu/status.py`, `gpu/watch.py`), so the scripted fake in `gpu/fake.py`
exercises all of that logic.

`pynvml` (distribution `nvidia-ml-py`, extra `gpu`) is imported only inside
`open_nvml`. A missing package is `MissingExtra` (exit 2, the install hint), a
missing library or driver `Unreachable` (exit 3) with a message that says which
one; never a traceback.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dynamo_ftctl.errors import FtctlError, MissingExtra, Unreachable

__all__ = [
    "GpuSnapshot",
    "NvmlBackend",
    "PynvmlBackend",
    "XidSignal",
    "normalize_pci_bus_id",
    "open_nvml",
]

_T = TypeVar("_T")

@dataclass(frozen=True)
class GpuSnapshot:
    """Raw readings of one GPU at one moment; `None` where the GPU does not support it.

    Memory is in bytes, power in watts, temperature in °C, utilisation in %.
    `throttle_mask` is NVML's clocks-event-reason bit mask (decoded in
    `gpu/status.py`); `nvlink` holds one up/down flag per link that exists.
    """

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    util_gpu: int | None = None
    util_memory: int | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    throttle_mask: int | None = None
    nvlink: tuple[bool, ...] = ()


@dataclass(frozen=True)
class XidSignal:
    """One Xid critical-error event delivered by NVML's event set."""

    index: int
    xid: int
    gpu_instance: int | None = None
    compute_instance: int | None = None


class NvmlBackend(Protocol):
    """What ftctl needs from NVML, and nothing more."""

    def device_count(self) -> int:
        """Number of GPUs the driver sees."""
        ...

    def snapshot(self, index: int) -> GpuSnapshot:
        """Current readings of GPU `index`."""
        ...

    def wait_xid(self, timeout_ms: int) -> XidSignal | None:
        """The next Xid event, or None after `timeout_ms` without one."""
        ...

    def close(self) -> None:
        """Release NVML (idempotent)."""
        ...


_PCI = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$"
)


def normalize_pci_bus_id(bus_id: str) -> str | None:
    """One spelling for a PCI id: `dddd:bb:dd` in lower case, or None if it is not one.

    NVML says `00000000:3B:00.0`; the kernel log says `0000:3b:00` or, on old
    drivers, `3b:00`. A missing domain is domain 0; the function is dropped
    (a GPU is function 0).
    """
    text = bus_id.strip()
    if text[:4].upper() == "PCI:":
        text = text[4:]
    match = _PCI.match(text)
    if match is None:
        return None
    domain = int(match.group("domain") or "0", 16) & 0xFFFF
    return f"{domain:04x}:{int(match.group('bus'), 16):02x}:{int(match.group('dev'), 16):02x}"


class PynvmlBackend:
    """The real NVML, through `pynvml`. Construct with `open_nvml()`."""

    def __init__(self, module: Any) -> None:
        self._nv = module
        self._handles: dict[int, Any] = {}
        self._event_set: Any = None
        self._closed = False

    # -- helpers -----------------------------------------------------------------

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            handle = self._call(self._nv.nvmlDeviceGetHandleByIndex, index)
            self._handles[index] = handle
        return handle

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        with translate_nvml_errors(self._nv):
            return fn(*args)

    def _optional(self, fn: Callable[..., _T], *args: Any) -> _T | None:
        """A reading the GPU may not support: None instead of an error."""
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:
            if _is_fatal(self._nv, exc):
                with translate_nvml_errors(self._nv):
                    raise
            return None

    # -- NvmlBackend ---------------------------------------------------------------

    def device_count(self) -> int:
        return int(self._call(self._nv.nvmlDeviceGetCount))

    def snapshot(self, index: int) -> GpuSnapshot:
        nv = self._nv
        h = self._handle(index)
        util = self._optional(nv.nvmlDeviceGetUtilizationRates, h)
        mem = self._optional(nv.nvmlDeviceGetMemoryInfo, h)
        power_mw = self._optional(nv.nvmlDeviceGetPowerUsage, h)
        limit_mw = self._optional(nv.nvmlDeviceGetEnforcedPowerLimit, h)
        remap = self._optional(nv.nvmlDeviceGetRemappedRows, h)
        # Renamed in NVML 12.2 ("throttle" → "clocks event"); older bindings have the old name.
        reasons_fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return GpuSnapshot(
            index=index,
            name=_text(self._call(nv.nvmlDeviceGetName, h)),
            uuid=_text(self._call(nv.nvmlDeviceGetUUID, h)),
            pci_bus_id=_text(self._call(nv.nvmlDeviceGetPciInfo, h).busId),
            util_gpu=int(util.gpu) if util is not None else None,
            util_memory=int(util.memory) if util is not None else None,
            memory_used=int(mem.used) if mem is not None else None,
            memory_total=int(mem.total) if mem is not None else None,
            temperature_c=self._optional(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            ecc_volatile_uncorrected=self._optional(
                nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            ),
            ecc_aggregate_uncorrected=self._optional(
                nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_AGGREGATE_ECC,
            ),
            remapped_rows_correctable=int(remap[0]) if remap is not None else None,
            remapped_rows_uncorrectable=int(remap[1]) if remap is not None else None,
            remap_pending=bool(remap[2]) if remap is not None else None,
            remap_failure=bool(remap[3]) if remap is not None else None,
            throttle_mask=self._optional(reasons_fn, h),
            nvlink=self._nvlink_states(h),
        )

    def _nvlink_states(self, handle: Any) -> tuple[bool, ...]:
        states: list[bool] = []
        for link in range(int(getattr(self._nv, "NVML_NVLINK_MAX_LINKS", 18))):
            state = self._optional(self._nv.nvmlDeviceGetNvLinkState, handle, link)
            if state is None:
                # Links are numbered densely; the first unsupported one ends the list
                # on PCIe boards (no NVLink at all) and past the last link on SXM.
                break
            states.append(bool(state))
        return tuple(states)

    def _ensure_event_set(self) -> Any:
        if self._event_set is not None:
            return self._event_set
        nv = self._nv
        event_set = self._call(nv.nvmlEventSetCreate)
        registered = 0
        for index in range(self.device_count()):
            try:
                nv.nvmlDeviceRegisterEvents(
                    self._handle(index), nv.nvmlEventTypeXidCriticalError, event_set
                )
                registered += 1
            except nv.NVMLError as exc:
                if _is_fatal(nv, exc):
                    with translate_nvml_errors(nv):
                        raise
                # NotSupported (e.g. some GPUs in a VM): that GPU is polled only.
        if registered == 0:
            msg = "no GPU supports NVML Xid events here; use `ftctl gpu kmsg` instead"
            raise Unreachable(msg)
        self._event_set = event_set
        return event_set

    def wait_xid(self, timeout_ms: int) -> XidSignal | None:
        nv = self._nv
        event_set = self._ensure_event_set()
        with translate_nvml_errors(nv):
            try:
                data = nv.nvmlEventSetWait_v2(event_set, max(0, int(timeout_ms)))
            except nv.NVMLError_Timeout:
                return None
        if not int(data.eventType) & int(nv.nvmlEventTypeXidCriticalError):
            return None
        index = int(self._call(nv.nvmlDeviceGetIndex, data.device))
        gi = int(getattr(data, "gpuInstanceId", 0xFFFFFFFF))
        ci = int(getattr(data, "computeInstanceId", 0xFFFFFFFF))
        return XidSignal(
            index=index,
            xid=int(data.eventData),
            # 0xFFFFFFFF means "not a MIG instance" in NVML.
            gpu_instance=None if gi == 0xFFFFFFFF else gi,
            compute_instance=None if ci == 0xFFFFFFFF else ci,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            if self._event_set is not None:
                self._nv.nvmlEventSetFree(self._event_set)
        with contextlib.suppress(Exception):
            self._nv.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fatal_classes(nv: Any) -> tuple[type[BaseException], ...]:
    names = (
        "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_GpuIsLost",
        "NVMLError_Uninitialized", "NVMLError_NoPermission",
    )
    return tuple(getattr(nv, name) for name in names if hasattr(nv, name))


def _is_fatal(nv: Any, exc: BaseException) -> bool:
    return isinstance(exc, _fatal_classes(nv))


_MESSAGES = (
    ("NVMLError_LibraryNotFound",
     "NVML library not found (libnvidia-ml.so.1): no NVIDIA driver on this host"),
    ("NVMLError_DriverNotLoaded", "NVIDIA driver not loaded: no GPU visible (is this a GPU node?)"),
    ("NVMLError_GpuIsLost",
     "a GPU is lost (fell off the bus, Xid 79): drain the node and reboot it"),
    ("NVMLError_NoPermission",
     "no permission to query NVML (run as a user with access to /dev/nvidia*)"),
)


@contextlib.contextmanager
def translate_nvml_errors(nv: Any) -> Iterator[None]:
    """Turn NVML's exceptions into ftctl's: missing driver or lost GPU → Unreachable."""
    try:
        yield
    except FtctlError:
        raise
    except nv.NVMLError as exc:
        msg = f"NVML error: {exc}"
        for name, text in _MESSAGES:
            cls = getattr(nv, name, None)
            if isinstance(cls, type) and isinstance(exc, cls):
                msg = text
                break
        raise Unreachable(msg) from exc


def open_nvml() -> PynvmlBackend:
    """Initialise the real NVML; `MissingExtra` (exit 2) without the gpu extra's pynvml,
    `Unreachable` (exit 3) when there is no NVML library or driver to talk to."""
    try:
        import pynvml
    except ImportError as exc:
        raise MissingExtra("pynvml", "gpu") from exc
    with translate_nvml_errors(pynvml):
        pynvml.nvmlInit()
    return PynvmlBackend(pynvml)
