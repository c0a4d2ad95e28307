"""The NVML watcher over the scripted fake: Xid events, polled ECC/remap/throttle/NVLink."""

from __future__ import annotations

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import Unreachable
from dynamo_ftctl.gpu.events import GpuEvent, WorkerMap
from dynamo_ftctl.gpu.fake import FakeGpu, FakeNvml, ScriptStep
from dynamo_ftctl.gpu.watch import GpuWatcher
from dynamo_ftctl.xid import XidAction


class _W:
    def __init__(self, name: str, node: str, gpus: tuple[int, ...]) -> None:
        self.name, self.node, self.gpus = name, node, gpus


class _Inv:
    workers = (_W("w1", "node-a", (0, 1)), _W("w2", "node-a", (2, 3)), _W("w9", "node-b", (2,)))


def _watcher(nvml: FakeNvml, clock: FakeClock, interval: float = 1.0) -> GpuWatcher:
    return GpuWatcher(nvml, node="node-a", clock=clock, workers=WorkerMap(_Inv()),
                      poll_interval_s=interval)


def _run(watcher: GpuWatcher, nvml: FakeNvml, extra_steps: int = 2) -> list[GpuEvent]:
    """Step until the script is played, then a few more polls; bounded."""
    events: list[GpuEvent] = []
    for _ in range(200):
        events.extend(watcher.step())
        if nvml.exhausted:
            extra_steps -= 1
            if extra_steps < 0:
                break
    return events


def test_xid_48_event_resets_gpu_and_names_the_worker() -> None:
    """An NVML Xid 48 on GPU 2 gives a RESET_GPU event naming w2 only."""
    clock = FakeClock()
    nvml = FakeNvml(4, clock=clock, script=[ScriptStep(), ScriptStep(xids=((2, 48),))])
    events = [e for e in _run(_watcher(nvml, clock), nvml) if e.kind == "xid"]
    assert len(events) == 1
    event = events[0]
    assert event.xid == 48
    assert event.gpu == 2
    assert event.action is XidAction.RESET_GPU
    assert event.workers == ("w2",)
    assert event.node == "node-a"
    assert event.source == "nvml"
    assert event.pci_bus_id == "0000:38:00"
    assert event.to_json()["action"] == "RESET_GPU"


def test_ecc_rise_is_reported_once_per_change() -> None:
    """Each rise of the uncorrected ECC counters gives exactly one event."""
    clock = FakeClock()
    nvml = FakeNvml(2, clock=clock, script=[
        ScriptStep(set={1: {"ecc_volatile_uncorrected": 1, "ecc_aggregate_uncorrected": 1}}),
        ScriptStep(),
        ScriptStep(),
        ScriptStep(set={1: {"ecc_volatile_uncorrected": 3, "ecc_aggregate_uncorrected": 3}}),
        ScriptStep(),
    ])
    events = [e for e in _run(_watcher(nvml, clock), nvml, extra_steps=5) if e.kind == "ecc"]
    assert [e.details["volatile"] for e in events] == [[0, 1], [1, 3]]
    assert all(e.gpu == 1 and e.workers == ("w1",) for e in events)
    assert all(e.action is XidAction.RESET_GPU for e in events)


def test_ecc_counter_reset_is_not_an_event() -> None:
    """A GPU reset clearing the volatile counter is not reported as a change."""
    clock = FakeClock()
    gpu = FakeGpu(0, ecc_volatile_uncorrected=4, ecc_aggregate_uncorrected=4)
    nvml = FakeNvml([gpu], clock=clock,
                    script=[ScriptStep(set={0: {"ecc_volatile_uncorrected": 0}})])
    assert _run(_watcher(nvml, clock), nvml) == []


def test_remap_pending_then_failure() -> None:
    """A pending remap asks for a reset; a remap failure asks for support, once each."""
    clock = FakeClock()
    nvml = FakeNvml(1, clock=clock, script=[
        ScriptStep(set={0: {"remap_pending": True, "remapped_rows_uncorrectable": 1}}),
        ScriptStep(),
        ScriptStep(set={0: {"remap_failure": True}}),
    ])
    events = [e for e in _run(_watcher(nvml, clock), nvml) if e.kind == "remap"]
    assert [e.action for e in events] == [XidAction.RESET_GPU, XidAction.CONTACT_SUPPORT]


def test_throttle_changes_and_nvlink_down() -> None:
    """Thermal throttling on and off, and a link going down, are each reported."""
    clock = FakeClock()
    nvml = FakeNvml(1, clock=clock, script=[
        ScriptStep(set={0: {"throttle_mask": 0x40 | 0x4}}),
        ScriptStep(set={0: {"throttle_mask": 0x4}}),
        ScriptStep(set={0: {"nvlink": (True, False) + (True,) * 16}}),
    ])
    events = _run(_watcher(nvml, clock), nvml)
    throttle = [e for e in events if e.kind == "throttle"]
    assert [e.details["reasons"] for e in throttle] == [["hw_thermal"], []]
    assert all(e.action is XidAction.IGNORE for e in throttle)
    (link,) = [e for e in events if e.kind == "nvlink"]
    assert link.details["links_down"] == [1]
    assert link.action is XidAction.RESET_GPU


def test_polls_follow_the_interval_without_sleeping() -> None:
    """Waits for events last until the next poll; the fake clock moves, nothing sleeps."""
    clock = FakeClock()
    nvml = FakeNvml(1, clock=clock)
    watcher = _watcher(nvml, clock, interval=2.0)
    start = clock.now()
    for _ in range(5):
        watcher.step()
    assert clock.now() - start == 10.0


def test_xid_storm_is_drained_in_one_wakeup() -> None:
    """Queued events are delivered together, then polling goes on."""
    clock = FakeClock()
    nvml = FakeNvml(2, clock=clock)
    watcher = _watcher(nvml, clock)
    watcher.start()
    for _ in range(3):
        nvml.push_xid(0, 13)
    nvml.push_xid(1, 79)
    events = watcher.step()
    assert [(e.gpu, e.xid) for e in events] == [(0, 13), (0, 13), (0, 13), (1, 79)]
    assert events[-1].action is XidAction.RESTART_BM


def test_lost_gpu_is_reported_once_and_watching_goes_on() -> None:
    """A GPU that stops answering gives one RESTART_BM event; the others are still polled."""
    clock = FakeClock()

    class Flaky(FakeNvml):
        def snapshot(self, index: int):  # type: ignore[no-untyped-def]
            if index == 1 and self.waits >= 2:
                raise Unreachable("a GPU is lost")
            return super().snapshot(index)

    nvml = Flaky(2, clock=clock)
    watcher = _watcher(nvml, clock)
    events: list[GpuEvent] = []
    for _ in range(5):
        events.extend(watcher.step())
    nvml.gpus[0].ecc_aggregate_uncorrected = 9
    for _ in range(2):
        events.extend(watcher.step())
    assert [(e.kind, e.gpu) for e in events] == [("lost", 1), ("ecc", 0)]
    assert events[0].action is XidAction.RESTART_BM


def test_run_stops_when_told() -> None:
    """run() yields events until stop() is true."""
    clock = FakeClock()
    nvml = FakeNvml(1, clock=clock, script=[ScriptStep(xids=((0, 48), (0, 63)))])
    watcher = _watcher(nvml, clock)
    events = list(watcher.run(stop=lambda: nvml.exhausted))
    assert [e.xid for e in events] == [48, 63]
    assert [e.actionable for e in events] == [True, False]
