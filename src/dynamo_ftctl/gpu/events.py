"""The GPU event record shared by `gpu watch` (NVML) and `gpu kmsg` (kernel log).

A `GpuEvent` says what happened on which GPU of which node, what NVIDIA's
catalog says to do about it, and which inventory workers it hits (by `node`
and `gpus`). Both watchers emit exactly this record as a JSON line, and the
canary daemon receives its `reason` through `POST /report`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from dynamo_ftctl.xid import XID_CATALOG, XidAction, action_for_message

__all__ = [
    "EventKind",
    "GpuEvent",
    "WorkerMap",
    "count_xid",
    "xid_event",
]

EventKind = Literal["xid", "ecc", "remap", "throttle", "nvlink", "lost"]


@dataclass(frozen=True)
class GpuEvent:
    """One GPU fault or health change, ready to print as a JSON line."""

    ts: float
    source: Literal["nvml", "kmsg"]
    kind: EventKind
    node: str
    gpu: int | None
    pci_bus_id: str | None
    xid: int | None
    name: str
    action: XidAction
    message: str
    workers: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def actionable(self) -> bool:
        """True unless the catalog says to ignore it."""
        return self.action is not XidAction.IGNORE

    @property
    def reason(self) -> str:
        """One line for the canary daemon and people: `xid 48: Double Bit ECC Error ...`."""
        if self.xid is not None:
            return f"xid {self.xid}: {self.name} ({self.action.value})"
        return f"{self.kind}: {self.message} ({self.action.value})"

    def to_json(self) -> dict[str, Any]:
        return {
            "ts": self.ts,
            "source": self.source,
            "kind": self.kind,
            "node": self.node,
            "gpu": self.gpu,
            "pci_bus_id": self.pci_bus_id,
            "xid": self.xid,
            "name": self.name,
            "action": self.action.value,
            "action_summary": self.action.summary,
            "message": self.message,
            "workers": list(self.workers),
            "details": dict(self.details),
        }

    def describe(self) -> str:
        """One line for people (the non-JSON rendering of a stream)."""
        gpu = f"gpu {self.gpu}" if self.gpu is not None else "gpu ?"
        pci = f" ({self.pci_bus_id})" if self.pci_bus_id else ""
        workers = f" workers: {', '.join(self.workers)}" if self.workers else ""
        return f"{self.node} {gpu}{pci} {self.reason}: {self.action.summary}.{workers}"


class _WorkerLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def gpus(self) -> Iterable[int]: ...


class _InventoryLike(Protocol):
    @property
    def workers(self) -> Iterable[_WorkerLike]: ...


class WorkerMap:
    """Which workers run on a (node, GPU); built once from the inventory."""

    def __init__(self, inventory: _InventoryLike | None = None) -> None:
        self._by_gpu: dict[tuple[str, int], list[str]] = {}
        self._by_node: dict[str, list[str]] = {}
        if inventory is None:
            return
        for worker in inventory.workers:
            self._by_node.setdefault(worker.node, []).append(worker.name)
            for gpu in worker.gpus:
                self._by_gpu.setdefault((worker.node, gpu), []).append(worker.name)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self._by_node)

    def workers(self, node: str, gpu: int | None) -> tuple[str, ...]:
        """Workers using `gpu` on `node`; every worker of the node when the GPU is unknown.

        An unknown GPU (a PCI id we could not map) must not hide a fault, so the
        whole node is named rather than nobody.
        """
        if gpu is None:
            return tuple(self._by_node.get(node, ()))
        return tuple(self._by_gpu.get((node, gpu), ()))


def xid_event(
    *, xid: int, ts: float, source: Literal["nvml", "kmsg"], node: str, gpu: int | None,
    pci_bus_id: str | None, message: str, workers: WorkerMap,
    details: Mapping[str, Any] | None = None,
) -> GpuEvent:
    """The event for one Xid, with the catalog's name and the per-message action."""
    info = XID_CATALOG.get(xid)
    return GpuEvent(
        ts=ts, source=source, kind="xid", node=node, gpu=gpu, pci_bus_id=pci_bus_id, xid=xid,
        name=info.meaning if info is not None else "Xid not in ftctl's catalog",
        action=action_for_message(xid, message),
        message=message or (info.meaning if info is not None else ""),
        workers=workers.workers(node, gpu),
        details=dict(details or {}),
    )


def count_xid(event: GpuEvent) -> None:
    """Count an Xid event in `ftctl_xid_events_total{gpu,xid}` (other kinds are ignored)."""
    if event.xid is None:
        return
    gpu = str(event.gpu) if event.gpu is not None else (event.pci_bus_id or "unknown")
    key = (gpu, event.xid)
    child = _XID_CHILDREN.get(key)
    if child is None:
        from dynamo_ftctl.metrics import XID_EVENTS

        # labels() costs ~10 µs; a storm of Xids on one GPU reuses the child.
        child = _XID_CHILDREN[key] = XID_EVENTS.labels(gpu=gpu, xid=str(event.xid))
    child.inc()


_XID_CHILDREN: dict[tuple[str, int], Any] = {}
