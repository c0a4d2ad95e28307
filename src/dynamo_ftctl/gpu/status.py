"""`ftctl gpu status`: per-GPU readings, decoded throttle reasons and a health verdict.

Reads through any `NvmlBackend`; decodes NVML's clocks-event-reason bit mask
into names and groups (thermal, power, HW slowdown); lists the problems an
operator should act on. Rendering is `output.py`'s job via `__rich__`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.gpu.nvml import GpuSnapshot, NvmlBackend, normalize_pci_bus_id

if TYPE_CHECKING:
    from rich.console import Group

__all__ = [
    "PROBLEM_THROTTLE",
    "THROTTLE_REASONS",
    "GpuStatus",
    "GpuStatusReport",
    "decode_throttle",
    "gpu_problems",
    "read_status",
]

# NVML nvmlClocksEventReason* bits (nvml.h; same values as the older
# nvmlClocksThrottleReason* names).
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
)

# Reasons that mean the GPU is slower than it should be through no choice of
# ours. The software power cap is left out: it is normal under full load.
PROBLEM_THROTTLE = frozenset({"hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"})


def decode_throttle(mask: int | None) -> tuple[str, ...]:
    """Names of the set bits; unknown bits show as `bit_0x...`."""
    if not mask:
        return ()
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


def throttle_groups(reasons: Sequence[str]) -> tuple[str, ...]:
    """The three groups people ask about: thermal, power, HW slowdown."""
    groups = []
    if {"sw_thermal", "hw_thermal"} & set(reasons):
        groups.append("thermal")
    if {"sw_power_cap", "hw_power_brake"} & set(reasons):
        groups.append("power")
    if {"hw_slowdown", "hw_thermal", "hw_power_brake"} & set(reasons):
        groups.append("hw_slowdown")
    return tuple(groups)


def gpu_problems(snap: GpuSnapshot) -> tuple[str, ...]:
    """What is wrong with one GPU, worst first; empty when healthy."""
    problems: list[str] = []
    if snap.remap_failure:
        problems.append("row remapping failed: drain and contact support (RMA)")
    if snap.ecc_volatile_uncorrected:
        problems.append(
            f"{snap.ecc_volatile_uncorrected} uncorrected ECC error(s) since the last reset"
        )
    if snap.remap_pending:
        problems.append("row remap pending: drain and reset the GPU to apply it")
    down = [i for i, up in enumerate(snap.nvlink) if not up]
    if down:
        problems.append(f"NVLink down: link(s) {', '.join(map(str, down))}")
    bad = sorted(PROBLEM_THROTTLE & set(decode_throttle(snap.throttle_mask)))
    if bad:
        problems.append(f"clocks throttled: {', '.join(bad)}")
    return tuple(problems)


@dataclass(frozen=True)
class GpuStatus:
    """One GPU's readings with decoded throttle reasons and its problems."""

    snapshot: GpuSnapshot
    throttle_reasons: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self.snapshot)
        doc["nvlink"] = {
            "links": len(self.snapshot.nvlink),
            "up": sum(self.snapshot.nvlink),
            "down": [i for i, up in enumerate(self.snapshot.nvlink) if not up],
        }
        doc["throttle_reasons"] = list(self.throttle_reasons)
        doc["throttle"] = list(throttle_groups(self.throttle_reasons))
        doc["problems"] = list(self.problems)
        doc["healthy"] = self.healthy
        return doc


@dataclass(frozen=True)
class GpuStatusReport:
    """Every GPU on this host; healthy when none has a problem."""

    gpus: tuple[GpuStatus, ...]

    @property
    def healthy(self) -> bool:
        return all(g.healthy for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "gpus": [g.to_json() for g in self.gpus]}

    def __rich__(self) -> Group:
        from rich.console import Group
        from rich.text import Text

        from dynamo_ftctl.output import table

        rows = []
        notes: list[Text] = []
        for g in self.gpus:
            s = g.snapshot
            rows.append((
                s.index, normalize_pci_bus_id(s.pci_bus_id) or s.pci_bus_id, _pct(s.util_gpu),
                _mem(s.memory_used, s.memory_total), _unit(s.temperature_c, "°C"),
                _power(s.power_w, s.power_limit_w),
                f"{_num(s.ecc_volatile_uncorrected)}/{_num(s.ecc_aggregate_uncorrected)}",
                _remap(s),
            ))
            links = f"nvlink {sum(s.nvlink)}/{len(s.nvlink)} up" if s.nvlink else "no nvlink"
            throttle = ",".join(throttle_groups(g.throttle_reasons)) or "none"
            notes.append(Text(f"gpu {s.index}: {s.name} {s.uuid}"))
            notes.append(Text(f"  throttle {throttle}, {links}"))
            if g.healthy:
                notes.append(Text("  ok", style="green"))
            notes.extend(Text(f"  - {problem}", style="red") for problem in g.problems)
        # Few, narrow columns so the table fits 80 columns; the rest goes below it.
        grid = table(
            "GPU status",
            ["gpu", "pci", "util", "mem GiB", "temp", "power W", "ecc v/a", "remap"],
            rows,
        )
        return Group(grid, *notes)


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _pct(value: int | None) -> str:
    return "-" if value is None else f"{value}%"


def _unit(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:g}{unit}"


def _mem(used: int | None, total: int | None) -> str:
    if used is None or total is None:
        return "-"
    return f"{used / 1024**3:.0f}/{total / 1024**3:.0f}"


def _power(power: float | None, limit: float | None) -> str:
    if power is None:
        return "-"
    return f"{power:.0f}" if limit is None else f"{power:.0f}/{limit:.0f}"


def _remap(s: GpuSnapshot) -> str:
    if s.remap_pending is None:
        return "-"
    if s.remap_failure:
        return "FAILED"
    return "pending" if s.remap_pending else "ok"


def status_of(snap: GpuSnapshot) -> GpuStatus:
    """Decode one snapshot."""
    return GpuStatus(snap, decode_throttle(snap.throttle_mask), gpu_problems(snap))


def read_status(nvml: NvmlBackend) -> GpuStatusReport:
    """Read and decode every GPU the backend sees."""
    return GpuStatusReport(
        tuple(status_of(nvml.snapshot(i)) for i in range(nvml.device_count()))
    )
