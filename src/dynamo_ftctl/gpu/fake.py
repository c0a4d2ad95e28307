"""A scripted NVML for tests and demos: GPUs as plain mutable state plus a script.

`FakeNvml` implements `NvmlBackend`. Each GPU is a `FakeGpu` whose fields a
test may change directly; a script of `ScriptStep`s is played one step per
`wait_xid` call that finds no queued event, so a watcher loop can be driven
deterministically: "step 2: Xid 48 on GPU 1 and its volatile ECC count rises".
A wait that returns nothing "sleeps" its timeout on the injected clock: a
`FakeClock` advances at once, so tests never sleep.

`load_fake_nvml(path)` builds one from JSON, so the CLI can run on hosts
without GPUs (`FTCTL_FAKE_NVML=spec.json ftctl gpu watch`, demos and drills):

    {"gpus": 2,
     "script": [{"set": {"1": {"ecc_volatile_uncorrected": 1}}, "xids": [[1, 48]]}]}
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dynamo_ftctl.clock import Clock
from dynamo_ftctl.documents import load_json_file
from dynamo_ftctl.errors import FtctlError, InvalidInput
from dynamo_ftctl.gpu.nvml import GpuSnapshot, XidSignal
from dynamo_ftctl.output import one_line

__all__ = ["FakeGpu", "FakeNvml", "ScriptStep", "load_fake_nvml"]

_GIB = 1024**3
# Eight GPUs a node is the norm; a spec of a billion would only exhaust memory.
MAX_FAKE_GPUS = 256


@dataclass
class FakeGpu:
    """One fake GPU: a healthy idle H100 unless told otherwise."""

    index: int
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    pci_bus_id: str = ""
    util_gpu: int | None = 0
    util_memory: int | None = 0
    memory_used: int | None = 1 * _GIB
    memory_total: int | None = 80 * _GIB
    temperature_c: int | None = 35
    power_w: float | None = 70.0
    power_limit_w: float | None = 700.0
    ecc_volatile_uncorrected: int | None = 0
    ecc_aggregate_uncorrected: int | None = 0
    remapped_rows_correctable: int | None = 0
    remapped_rows_uncorrectable: int | None = 0
    remap_pending: bool | None = False
    remap_failure: bool | None = False
    throttle_mask: int | None = 0x1  # GPU idle
    nvlink: tuple[bool, ...] = field(default_factory=lambda: (True,) * 18)

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-00000000-0000-0000-0000-{self.index:012d}"
        if not self.pci_bus_id:
            # NVML's spelling: 8-digit domain, upper-case hex, function.
            self.pci_bus_id = f"00000000:{0x18 + 0x10 * self.index:02X}:00.0"

    def snapshot(self) -> GpuSnapshot:
        """The frozen reading NVML would return now."""
        names = {f.name for f in fields(GpuSnapshot)}
        return GpuSnapshot(**{name: getattr(self, name) for name in names})


@dataclass(frozen=True)
class ScriptStep:
    """One scripted moment: field updates per GPU, then Xid events to deliver."""

    set: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    xids: tuple[tuple[int, int], ...] = ()


class FakeNvml:
    """`NvmlBackend` over `FakeGpu`s and a script; no driver, no sleeping."""

    def __init__(
        self,
        gpus: int | Sequence[FakeGpu] = 1,
        *,
        script: Iterable[ScriptStep] = (),
        clock: Clock | None = None,
        error: FtctlError | None = None,
    ) -> None:
        self.gpus: list[FakeGpu] = (
            [FakeGpu(i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
        )
        self._script: deque[ScriptStep] = deque(script)
        self._queue: deque[XidSignal] = deque()
        self._clock = clock
        self._error = error
        self.waits = 0
        self.closed = False

    @property
    def exhausted(self) -> bool:
        """True once every scripted step has played and every event was delivered."""
        return not self._script and not self._queue

    def push_xid(self, gpu: int, xid: int) -> None:
        """Queue an Xid event for GPU `gpu`, delivered by the next `wait_xid`."""
        self._queue.append(XidSignal(index=gpu, xid=xid))

    def apply(self, step: ScriptStep) -> None:
        """Apply one step now: set the fields, queue the events."""
        for index, updates in step.set.items():
            gpu = self.gpus[index]
            for name, value in updates.items():
                if not hasattr(gpu, name):
                    msg = f"FakeGpu has no field {name!r}"
                    raise AttributeError(msg)
                setattr(gpu, name, value)
        for index, xid in step.xids:
            self.push_xid(index, xid)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def device_count(self) -> int:
        self._check()
        return len(self.gpus)

    def snapshot(self, index: int) -> GpuSnapshot:
        self._check()
        return replace(self.gpus[index].snapshot())

    def wait_xid(self, timeout_ms: int) -> XidSignal | None:
        self._check()
        self.waits += 1
        if not self._queue and self._script:
            self.apply(self._script.popleft())
        if self._queue:
            return self._queue.popleft()
        if self._clock is not None:
            # A FakeClock advances instantly; a real clock makes demos pace like NVML.
            self._clock.sleep(max(0, timeout_ms) / 1000.0)
        return None

    def close(self) -> None:
        self.closed = True


def load_fake_nvml(path: Path, *, clock: Clock | None = None) -> FakeNvml:
    """A `FakeNvml` from a JSON spec (see the module docstring); errors exit 2."""
    spec = load_json_file(path, what="a fake NVML spec (JSON)")
    try:
        gpus_spec = spec.get("gpus", 1)
        if isinstance(gpus_spec, int):
            if gpus_spec > MAX_FAKE_GPUS:
                msg = f"'gpus': at most {MAX_FAKE_GPUS}"
                raise ValueError(msg)
            gpus: list[FakeGpu] = [FakeGpu(i) for i in range(gpus_spec)]
        else:
            gpus = [
                FakeGpu(**{**g, "nvlink": tuple(g.get("nvlink", (True,) * 18))})
                for g in gpus_spec
            ]
        script = [
            ScriptStep(
                set={int(k): dict(v) for k, v in step.get("set", {}).items()},
                xids=tuple((int(g), int(x)) for g, x in step.get("xids", ())),
            )
            for step in spec.get("script", ())
        ]
    except (ValueError, TypeError, AttributeError) as exc:
        msg = one_line(f"{path}: not a fake NVML spec: {exc}")  # it may quote a key "\n"
        raise InvalidInput(msg) from exc
    return FakeNvml(gpus, script=script, clock=clock)
