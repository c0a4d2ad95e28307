"""`ftctl gpu watch`: Xid events from NVML's event set plus polled health changes.

The watcher waits on `NvmlBackend.wait_xid` for at most the time left until the
next poll, so an Xid is seen as soon as the driver reports it while ECC, row
remapping, throttle and NVLink readings are compared every `poll_interval_s`.
A change is reported once: a counter that rose, a flag that turned on, a set
of throttle reasons that changed, a link that went down. Time comes from a
`Clock`; with `FakeNvml` and `FakeClock` a whole scenario runs without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dynamo_ftctl.clock import Clock
from dynamo_ftctl.errors import Unreachable
from dynamo_ftctl.gpu.events import EventKind, GpuEvent, WorkerMap, xid_event
from dynamo_ftctl.gpu.nvml import GpuSnapshot, NvmlBackend, normalize_pci_bus_id
from dynamo_ftctl.gpu.status import PROBLEM_THROTTLE, decode_throttle
from dynamo_ftctl.xid import XidAction

__all__ = ["GpuWatcher", "diff_snapshots"]

# Events drained per wake-up: an Xid storm must not starve the polling.
_MAX_EVENTS_PER_WAKE = 64


@dataclass(frozen=True)
class _Change:
    kind: EventKind
    action: XidAction
    name: str
    message: str
    details: dict[str, object]


def _rose(before: int | None, after: int | None) -> bool:
    return before is not None and after is not None and after > before


def diff_snapshots(before: GpuSnapshot, after: GpuSnapshot) -> list[_Change]:
    """Health changes between two readings of one GPU (empty when nothing changed)."""
    changes: list[_Change] = []
    vol = (before.ecc_volatile_uncorrected, after.ecc_volatile_uncorrected)
    agg = (before.ecc_aggregate_uncorrected, after.ecc_aggregate_uncorrected)
    if _rose(*vol) or _rose(*agg):
        changes.append(_Change(
            "ecc", XidAction.RESET_GPU, "Uncorrected ECC errors rising",
            f"uncorrected ECC volatile {vol[0]}→{vol[1]}, aggregate {agg[0]}→{agg[1]}",
            {"volatile": list(vol), "aggregate": list(agg)},
        ))
    if after.remap_failure and not before.remap_failure:
        changes.append(_Change(
            "remap", XidAction.CONTACT_SUPPORT, "Row remapping failure",
            "row remapping failed: no spare rows left (RMA)",
            {"uncorrectable_rows": after.remapped_rows_uncorrectable},
        ))
    elif after.remap_pending and not before.remap_pending:
        changes.append(_Change(
            "remap", XidAction.RESET_GPU, "Row remap pending",
            "a row remap is pending and takes effect at the next GPU reset",
            {"uncorrectable_rows": after.remapped_rows_uncorrectable,
             "correctable_rows": after.remapped_rows_correctable},
        ))
    old = PROBLEM_THROTTLE & set(decode_throttle(before.throttle_mask))
    new = PROBLEM_THROTTLE & set(decode_throttle(after.throttle_mask))
    if old != new:
        message = (
            f"clocks throttled: {', '.join(sorted(new))}" if new else "clock throttling cleared"
        )
        changes.append(_Change(
            "throttle", XidAction.IGNORE, "Clock throttle reasons changed", message,
            {"reasons": sorted(new), "previous": sorted(old)},
        ))
    went_down = [
        i for i, (was, now) in enumerate(zip(before.nvlink, after.nvlink, strict=False))
        if was and not now
    ]
    if went_down:
        changes.append(_Change(
            "nvlink", XidAction.RESET_GPU, "NVLink link down",
            f"NVLink link(s) {', '.join(map(str, went_down))} went down",
            {"links_down": went_down},
        ))
    return changes


class GpuWatcher:
    """Turns NVML events and polled readings into `GpuEvent`s for one node."""

    def __init__(
        self, nvml: NvmlBackend, *, node: str, clock: Clock, workers: WorkerMap | None = None,
        poll_interval_s: float = 1.0,
    ) -> None:
        self._nvml = nvml
        self._node = node
        self._clock = clock
        self._workers = workers or WorkerMap()
        self._interval = max(0.0, poll_interval_s)
        self._last: dict[int, GpuSnapshot] = {}
        self._pci: dict[int, str] = {}
        self._lost: set[int] = set()
        self._next_poll = 0.0
        self._started = False

    def start(self) -> None:
        """Take the baseline readings: later changes are relative to them."""
        for index in range(self._nvml.device_count()):
            snap = self._nvml.snapshot(index)
            self._last[index] = snap
            self._pci[index] = normalize_pci_bus_id(snap.pci_bus_id) or snap.pci_bus_id
        self._next_poll = self._clock.now() + self._interval
        self._started = True

    def _event(self, index: int | None, change: _Change) -> GpuEvent:
        return GpuEvent(
            ts=self._clock.wall(), source="nvml", kind=change.kind, node=self._node, gpu=index,
            pci_bus_id=self._pci.get(index) if index is not None else None, xid=None,
            name=change.name, action=change.action, message=change.message,
            workers=self._workers.workers(self._node, index), details=change.details,
        )

    def poll(self) -> list[GpuEvent]:
        """Compare every GPU with its last reading; one event per change."""
        events: list[GpuEvent] = []
        for index, before in sorted(self._last.items()):
            if index in self._lost:
                continue
            try:
                after = self._nvml.snapshot(index)
            except Unreachable as exc:
                self._lost.add(index)
                events.append(self._event(index, _Change(
                    "lost", XidAction.RESTART_BM, "GPU lost", str(exc), {},
                )))
                continue
            events.extend(self._event(index, change) for change in diff_snapshots(before, after))
            self._last[index] = after
        return events

    def step(self) -> list[GpuEvent]:
        """Wait for Xid events until the next poll is due, then poll if it is."""
        if not self._started:
            self.start()
        events: list[GpuEvent] = []
        wait_ms = max(0, round((self._next_poll - self._clock.now()) * 1000))
        signal = self._nvml.wait_xid(wait_ms)
        while signal is not None:
            info_message = ""
            if signal.gpu_instance is not None:
                info_message = f"MIG gpu instance {signal.gpu_instance}"
            events.append(xid_event(
                xid=signal.xid, ts=self._clock.wall(), source="nvml", node=self._node,
                gpu=signal.index, pci_bus_id=self._pci.get(signal.index),
                message=info_message, workers=self._workers,
                details={"gpu_instance": signal.gpu_instance,
                         "compute_instance": signal.compute_instance},
            ))
            if len(events) >= _MAX_EVENTS_PER_WAKE:
                break
            signal = self._nvml.wait_xid(0)
        if self._clock.now() >= self._next_poll:
            events.extend(self.poll())
            self._next_poll = self._clock.now() + self._interval
        return events

    def run(self, stop: Callable[[], bool] = lambda: False) -> Iterator[GpuEvent]:
        """Events as they come, until `stop()` is true (checked between wake-ups)."""
        while not stop():
            yield from self.step()
