"""Chaos-drill scenarios: the YAML a drill runs, as frozen pydantic models.

A scenario names its inventory, a steady-state hypothesis (probes with
tolerances), a method (a load profile and a timeline of faults and probes at
offsets) and rollbacks. `load_scenario` validates it with the inventory's
one-line `file:line: key: message` errors, and checks every timeline entry
against the inventory: the worker exists, the fault is in its allowlist, the
worker is not protected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.inventory import (
    FaultName,
    Inventory,
    KeyedValueError,
    Name,
    load_inventory,
    load_yaml_document,
    validation_error_to_inventory_error,
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


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Probe(_Model):
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

    name: str = Field(min_length=1)
    kind: StateProbeKind | MetricProbeKind
    workers: tuple[Name, ...] = Field((), description="Workers to probe (default: all).")
    within_s: float = Field(10.0, gt=0, le=600, description="State probes: time to pass.")
    max: float | None = Field(None, ge=0, description="Metric probes: the tolerance.")
    expect: Literal["healthy", "unhealthy"] = "healthy"
    priority: Literal["premium", "standard", "best_effort"] | None = Field(
        None, description="Metric probes: judge only this priority's load; shed: its header.")

    @model_validator(mode="after")
    def _tolerance(self) -> Probe:
        if self.kind in METRIC_KINDS and self.max is None:
            raise KeyedValueError(("max",), f"a {self.kind} probe needs a tolerance 'max'")
        if self.kind == "shed" and self.priority is None:
            raise KeyedValueError(("priority",), "a shed probe needs the priority to send")
        return self


class Hypothesis(_Model):
    """The steady state: what must hold before and after the method."""

    probes: tuple[Probe, ...] = Field(min_length=1)


class LoadProfile(_Model):
    """Open-loop load from the load generator while the timeline runs.

    `priority` sends `x-ftctl-priority` on every request (the proxy's tiers).
    """

    rate: float = Field(8.0, gt=0, le=10_000, description="Requests per second (Poisson).")
    duration_s: float = Field(15.0, gt=0, le=3600)
    prompt_tokens: int = Field(16, ge=1, le=32_768)
    max_tokens: int = Field(48, ge=1, le=32_768)
    stream: bool = True
    via: Literal["proxy", "workers"] = Field("proxy", description="Send through the proxy.")
    timeout_s: float = Field(30.0, gt=0)
    priority: Literal["premium", "standard", "best_effort"] | None = None
    concurrency: int | None = Field(None, ge=1)
    seed: int = 0


class Witness(_Model):
    """Greedy streams with token ids sent through the proxy at `at_s`, across the faults.

    After the method each request runs again straight from a healthy worker; every
    stream's ids must equal that fault-free run (`faults/witness.py`).
    """

    at_s: float = Field(0.0, ge=0, description="When the streams start (before the fault).")
    streams: int = Field(4, ge=1, le=256)
    prompt_tokens: int = Field(16, ge=1, le=4096)
    max_tokens: int = Field(256, ge=1, le=32_768, description="Long enough to span the fault.")
    timeout_s: float = Field(120.0, gt=0)
    reference_concurrency: int = Field(
        1, ge=1, le=256, description="Fault-free runs at once (1: one at a time; more only "
        "where the engine's greedy output does not depend on its batch, as ftctl sim's).")


class TimelineEntry(_Model):
    """At `at_s` into the method: inject `fault` into `worker`, or run a `probe`."""

    at_s: float = Field(ge=0)
    fault: FaultName | None = None
    worker: Name | None = None
    duration_s: float | None = Field(None, gt=0, description="Revert after this long.")
    delay_ms: float = Field(50.0, ge=0)
    jitter_ms: float = Field(0.0, ge=0)
    after_tokens: int = Field(20, ge=0)
    rate_kbps: float = Field(64.0, gt=0)
    witness_tokens: int | None = Field(
        None, ge=1, description="After `at_s`, also wait (at most 60 s) until every "
        "witness stream has this many tokens: the fault lands mid-stream however slow "
        "the engine.")
    probe: Probe | None = None

    @model_validator(mode="after")
    def _one_thing(self) -> TimelineEntry:
        if (self.fault is None) == (self.probe is None):
            raise KeyedValueError(("fault",), "give either a fault (with a worker) or a probe")
        if self.fault is not None and self.worker is None:
            raise KeyedValueError(("worker",), "a fault needs the worker to inject it into")
        return self


class Method(_Model):
    """What the drill does: a load profile (or several at once) and a timeline."""

    load: LoadProfile | None = None
    loads: tuple[LoadProfile, ...] = Field(
        (), description="Load profiles run at the same time (each its own priority).")
    timeline: tuple[TimelineEntry, ...] = Field(min_length=1)
    settle_s: float = Field(1.0, ge=0, le=600, description="Wait after the last entry.")
    witness: Witness | None = Field(
        None, description="Greedy token-id streams checked against a fault-free run.")

    @model_validator(mode="after")
    def _one_load_key(self) -> Method:
        if self.load is not None and self.loads:
            raise KeyedValueError(("loads",), "give 'load' or 'loads', not both")
        return self

    @property
    def profiles(self) -> tuple[LoadProfile, ...]:
        """Every load profile of the method (`load` alone or `loads`)."""
        return (self.load,) if self.load is not None else self.loads


class Rollback(_Model):
    """Undo the method: revert every fault still in force; restart dead local workers."""

    action: Literal["revert_faults", "restart_workers"]


class Scenario(_Model):
    """One chaos drill."""

    title: str = Field(min_length=1)
    description: str = ""
    inventory: str = Field(description="Inventory YAML, relative to the scenario file.")
    timeout_s: float = Field(300.0, gt=0, le=7200, description="Bound on the whole drill.")
    hypothesis: Hypothesis
    method: Method
    rollbacks: tuple[Rollback, ...] = (
        Rollback(action="revert_faults"), Rollback(action="restart_workers"),
    )

    @model_validator(mode="after")
    def _shed_in_timeline(self) -> Scenario:
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
        return self


def _check_against_inventory(scenario: Scenario, inventory: Inventory, path: Path,
                             line_of: object) -> None:
    names = {w.name for w in inventory.workers}

    def fail(loc: tuple[str | int, ...], message: str) -> InventoryError:
        from dynamo_ftctl.inventory import format_key_path

        line = line_of(loc) if callable(line_of) else None
        return InventoryError(message, path=path, line=line, key=format_key_path(loc))

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
    _, located = load_yaml_document(path, what="a drill scenario mapping")
    try:
        scenario = Scenario.model_validate(located.data)
    except ValidationError as exc:
        raise validation_error_to_inventory_error(exc, Scenario, located, path) from None
    inventory_path = Path(scenario.inventory)
    if not inventory_path.is_absolute():
        inventory_path = path.parent / inventory_path
    inventory = load_inventory(inventory_path)
    _check_against_inventory(scenario, inventory, path, located.line_of)
    return scenario, inventory
