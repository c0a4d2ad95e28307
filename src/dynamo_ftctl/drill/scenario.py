"""Chaos-drill scenarios: the YAML a drill runs, as frozen msgspec structs.

A scenario names its inventory, a steady-state hypothesis (probes with
tolerances), a method (a load profile and a timeline of faults and probes at
offsets) and rollbacks. `load_scenario` reads it through `structs.load_struct`
(one-line `file:line: key: message` errors, as every file format), and checks every timeline entry
against the inventory: the worker exists, the fault is in its allowlist, the
worker is not protected.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta

from dynamo_ftctl.documents import format_key_path, load_yaml_document
from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.faultnames import check_fault
from dynamo_ftctl.inventory import Inventory, load_inventory
from dynamo_ftctl.structs import (
    KeyedValueError,
    StrictStruct,
    check_name,
    convert_struct,
    doc,
)

__all__ = [
    "Hypothesis",
    "LoadProfile",
    "Method",
    "Probe",
    "Rollback",
    "Scenario",
    "TimelineEntry",
    "Witness",
    "load_scenario",
]

StateProbeKind = Literal["workers_healthy", "canary", "shed"]
MetricProbeKind = Literal[
    "error_rate", "failed", "ttft_p99_ms", "tokens_lost", "tokens_duplicated", "rejected_min",
    "drained_s", "admitted_error_rate", "ids_mismatched", "streams_cut_min",
]
METRIC_KINDS: tuple[str, ...] = (
    "error_rate", "failed", "ttft_p99_ms", "tokens_lost", "tokens_duplicated", "rejected_min",
    "drained_s", "admitted_error_rate", "ids_mismatched", "streams_cut_min",
)
Priority = Literal["premium", "standard", "best_effort"]


class Probe(StrictStruct, frozen=True, kw_only=True):
    """One check of the steady state, with its tolerance.

    State probes (`workers_healthy`, `canary`) run before and after the method;
    metric probes judge the method's load: `error_rate`, `failed`,
    `ttft_p99_ms`, `tokens_lost`, `tokens_duplicated` must be ≤ `max`;
    `rejected_min` needs at least `max` rejections (503/529) — for overload drills;
    `admitted_error_rate`: failures among the requests the proxy admitted (not shed);
    `drained_s`: the canary daemon took every injected worker (of `workers`) out of
    routing within `max` seconds of its fault (needs `canary.set`, `--local`).
    `ids_mismatched` (≤ max): witness streams whose token ids differ from the fault-free
    run; `streams_cut_min` (≥ max): witness streams the proxy moved and completed (both
    need `method.witness`).
    With `priority`, a metric probe judges only the load profile(s) of that
    priority. `shed` (timeline only) sends one request with the `priority` header
    to the proxy until, within `within_s`, one is shed with 503, a `Retry-After`
    header and exactly the busy body (Dynamo's "All workers are busy").
    """

    name: Annotated[str, Meta(min_length=1)]
    kind: StateProbeKind | MetricProbeKind
    workers: Annotated[tuple[str, ...], doc("Workers to probe (default: all).")] = ()
    within_s: Annotated[float, doc("State probes: time to pass.", gt=0, le=600)] = 10.0
    max: Annotated[float, doc("Metric probes: the tolerance.", ge=0)] | None = None
    expect: Literal["healthy", "unhealthy"] = "healthy"
    priority: Annotated[
        Priority | None, doc("Metric probes: judge only this priority's load; shed: its header."),
    ] = None
    _checked = (("workers", check_name),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind in METRIC_KINDS and self.max is None:
            raise KeyedValueError(("max",), f"a {self.kind} probe needs a tolerance 'max'")
        if self.kind == "shed" and self.priority is None:
            raise KeyedValueError(("priority",), "a shed probe needs the priority to send")


class Hypothesis(StrictStruct, frozen=True, kw_only=True):
    """The steady state: what must hold before and after the method."""

    probes: Annotated[tuple[Probe, ...], Meta(min_length=1)]


class LoadProfile(StrictStruct, frozen=True, kw_only=True):
    """Load from the load generator while the timeline runs.

    Open loop at `rate` (Poisson; 8 req/s when neither is given), or closed loop
    with `users`: N users, each sending its next request when its last one is
    answered, or, when it was shed with a `Retry-After`, once that has passed.
    A closed loop offers whatever the workers serve and more, however fast the
    machine: an overload drill's load (a fixed rate is an overload only on a
    machine too slow to serve it). `priority` sends `x-ftctl-priority` on every
    request (the proxy's tiers).
    """

    rate: Annotated[float, doc("Open loop: requests per second (Poisson).", gt=0,
                               le=10_000)] | None = None
    users: Annotated[int, doc("Closed loop: users, each one request at a time.", ge=1,
                              le=4096)] | None = None
    duration_s: Annotated[float, Meta(gt=0, le=3600)] = 15.0
    prompt_tokens: Annotated[int, Meta(ge=1, le=32_768)] = 16
    max_tokens: Annotated[int, Meta(ge=1, le=32_768)] = 48
    stream: bool = True
    via: Annotated[Literal["proxy", "workers"], doc("Send through the proxy.")] = "proxy"
    timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    priority: Priority | None = None
    concurrency: Annotated[int, Meta(ge=1)] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rate is not None and self.users is not None:
            raise KeyedValueError(("users",), "give 'rate' (open loop) or 'users' "
                                              "(closed loop), not both")

    @property
    def open_rate(self) -> float | None:
        """Requests per second of an open loop; None for a closed loop."""
        if self.users is not None:
            return None
        return 8.0 if self.rate is None else self.rate


class Witness(StrictStruct, frozen=True, kw_only=True):
    """Greedy streams with token ids sent through the proxy at `at_s`, across the faults.

    After the method each request runs again straight from a healthy worker; every
    stream's ids must equal that fault-free run (`faults/witness.py`).
    """

    at_s: Annotated[float, doc("When the streams start (before the fault).", ge=0)] = 0.0
    streams: Annotated[int, Meta(ge=1, le=256)] = 4
    prompt_tokens: Annotated[int, Meta(ge=1, le=4096)] = 16
    max_tokens: Annotated[int, doc("Long enough to span the fault.", ge=1, le=32_768)] = 256
    timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    reference_concurrency: Annotated[
        int, doc("Fault-free runs at once (1: one at a time; more only where the engine's "
                 "greedy output does not depend on its batch, as ftctl sim's).", ge=1, le=256),
    ] = 1


class TimelineEntry(StrictStruct, frozen=True, kw_only=True):
    """At `at_s` into the method: inject `fault` into `worker`, or run a `probe`."""

    at_s: Annotated[float, Meta(ge=0)]
    fault: str | None = None
    worker: str | None = None
    duration_s: Annotated[float, doc("Revert after this long.", gt=0)] | None = None
    delay_ms: Annotated[float, Meta(ge=0)] = 50.0
    jitter_ms: Annotated[float, Meta(ge=0)] = 0.0
    after_tokens: Annotated[int, Meta(ge=0)] = 20
    rate_kbps: Annotated[float, Meta(gt=0)] = 64.0
    witness_tokens: Annotated[
        int, doc("After `at_s`, also wait (at most 60 s) until the witness streams on the "
                 "fault's worker have this many tokens, and every stream is answered "
                 "unless one of the worker's is half done: the fault lands mid-stream "
                 "however slow the engine.", ge=1),
    ] | None = None
    probe: Probe | None = None
    _checked = (("fault", check_fault), ("worker", check_name))

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.fault is None) == (self.probe is None):
            raise KeyedValueError(("fault",), "give either a fault (with a worker) or a probe")
        if self.fault is not None and self.worker is None:
            raise KeyedValueError(("worker",), "a fault needs the worker to inject it into")


class Method(StrictStruct, frozen=True, kw_only=True):
    """What the drill does: a load profile (or several at once) and a timeline."""

    load: LoadProfile | None = None
    loads: Annotated[
        tuple[LoadProfile, ...], doc("Load profiles run at the same time (each its own priority)."),
    ] = ()
    timeline: Annotated[tuple[TimelineEntry, ...], Meta(min_length=1)]
    settle_s: Annotated[float, doc("Wait after the last entry.", ge=0, le=600)] = 1.0
    witness: Annotated[
        Witness | None, doc("Greedy token-id streams checked against a fault-free run."),
    ] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.load is not None and self.loads:
            raise KeyedValueError(("loads",), "give 'load' or 'loads', not both")

    @property
    def profiles(self) -> tuple[LoadProfile, ...]:
        """Every load profile of the method (`load` alone or `loads`)."""
        return (self.load,) if self.load is not None else self.loads


class Rollback(StrictStruct, frozen=True, kw_only=True):
    """Undo the method: revert every fault still in force; restart dead local workers."""

    action: Literal["revert_faults", "restart_workers"]


class Scenario(StrictStruct, frozen=True, kw_only=True):
    """One chaos drill."""

    title: Annotated[str, Meta(min_length=1)]
    description: str = ""
    inventory: Annotated[str, doc("Inventory YAML, relative to the scenario file.")]
    timeout_s: Annotated[float, doc("Bound on the whole drill.", gt=0, le=7200)] = 300.0
    hypothesis: Hypothesis
    method: Method
    rollbacks: tuple[Rollback, ...] = (
        Rollback(action="revert_faults"), Rollback(action="restart_workers"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for index, probe in enumerate(self.hypothesis.probes):
            if probe.kind in ("ids_mismatched", "streams_cut_min") and self.method.witness is None:
                raise KeyedValueError(("hypothesis", "probes", index, "kind"),
                                      f"a {probe.kind} probe needs method.witness")
            if probe.kind == "shed":
                raise KeyedValueError(("hypothesis", "probes", index, "kind"),
                                      "a shed probe runs in the method's timeline only")
        for index, entry in enumerate(self.method.timeline):
            if entry.witness_tokens is not None and self.method.witness is None:
                raise KeyedValueError(("method", "timeline", index, "witness_tokens"),
                                      "witness_tokens needs method.witness")


def _check_against_inventory(
    scenario: Scenario, inventory: Inventory, path: Path,
    line_of: Callable[[tuple[str | int, ...]], int | None],
) -> None:
    names = {w.name for w in inventory.workers}

    def fail(loc: tuple[str | int, ...], message: str) -> InventoryError:
        return InventoryError(message, path=path, line=line_of(loc), key=format_key_path(loc))

    for index, probe in enumerate(scenario.hypothesis.probes):
        for worker in probe.workers:
            if worker not in names:
                loc = ("hypothesis", "probes", index, "workers")
                raise fail(loc, f"no worker named {worker!r} in {inventory.source}")
    for index, entry in enumerate(scenario.method.timeline):
        if entry.worker is None or entry.fault is None:
            continue
        where: tuple[str | int, ...] = ("method", "timeline", index, "worker")
        if entry.worker not in names:
            raise fail(where, f"no worker named {entry.worker!r} in {inventory.source}")
        target = inventory.worker(entry.worker)
        if target.protected:
            raise fail(where, f"worker {target.name} is protected: fault injection refused")
        if entry.fault not in target.faults:
            raise fail(("method", "timeline", index, "fault"),
                       f"fault {entry.fault!r} is not in worker {target.name}'s allowlist")


def load_scenario(path: Path | str) -> tuple[Scenario, Inventory]:
    """Read and validate a scenario and its inventory; errors name file, line and key."""
    path = Path(path)
    # Not `load_struct`: the checks against the inventory need the scenario's line map.
    _, located = load_yaml_document(path, what="a drill scenario mapping")
    scenario = convert_struct(located.data, Scenario, located, path)
    inventory_path = Path(scenario.inventory)
    if not inventory_path.is_absolute():
        inventory_path = path.parent / inventory_path
    inventory = load_inventory(inventory_path)
    _check_against_inventory(scenario, inventory, path, located.line_of)
    return scenario, inventory
