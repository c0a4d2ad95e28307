"""The steady-state hypothesis: probes of the cluster's state, and verdicts on the measures.

State probes (`workers_healthy`, `canary`, `shed`) ask the cluster, each until
its `within_s` deadline: before the method, during it (a timeline entry) and
after the rollbacks. Metric probes (`failed`, `error_rate`, `ttft_p99_ms`, ...)
judge what the method measured (`counts`) against a tolerance; `drained_s`
judges how soon the canary daemon took a faulted worker out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.drill.state import ProbeOutcome
from dynamo_ftctl.errors import FtctlError
from dynamo_ftctl.http1 import Client, HttpError
from dynamo_ftctl.jsoncodec import loads

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from pathlib import Path

    from dynamo_ftctl.drill.scenario import Probe
    from dynamo_ftctl.drill.state import DrillRun

__all__ = ["check_probe", "check_probes", "detections", "judge_drained", "judge_metric"]

_HEALTH_TIMEOUT_S = 1.0  # one /health answer; the probe's within_s bounds the retries
_SHED_TIMEOUT_S = 5.0  # one request of the shed probe


def _probe_workers(run: DrillRun, probe: Probe) -> list[str]:
    return list(probe.workers) or [w.name for w in run.inventory.workers]


async def _workers_healthy(run: DrillRun, probe: Probe) -> tuple[bool, str]:
    deadline = run.clock.now() + probe.within_s
    waiting = _probe_workers(run, probe)
    client = Client()
    try:
        while True:
            down = []
            for name in waiting:
                url = run.inventory.worker(name).admin_url
                status = None
                with contextlib.suppress(HttpError, TimeoutError):
                    status, _ = await client.fetch("GET", f"{url}/health",
                                                   timeout_s=_HEALTH_TIMEOUT_S)
                if status != 200:
                    down.append(name)
            if not down:
                return True, f"all of {', '.join(waiting)} answer /health 200"
            if run.clock.now() >= deadline:
                return False, f"not healthy within {probe.within_s:g} s: {', '.join(down)}"
            waiting = down
            await run.clock.asleep(0.1)  # re-check a condition until its deadline
    finally:
        await client.close()


def _canary_verdicts(run: DrillRun, names: list[str]) -> dict[str, tuple[str, str]]:
    """Each worker's canary verdict and reason (blocking: one golden-set probe each)."""
    from dynamo_ftctl.health.probe import ProbeTarget, probe_worker
    from dynamo_ftctl.health.record import record_canary_set

    if run.canary_set is None:
        if run.inventory.canary.set is not None:
            from dynamo_ftctl.health.canaryset import load_canary_set

            run.canary_set = load_canary_set(run.inventory.resolve(run.inventory.canary.set))
        else:
            # No golden set named: record one from the first worker of the fresh cluster.
            first = run.inventory.workers[0]
            run.canary_set = record_canary_set(
                ProbeTarget(first.name, first.admin_url, first.model), model=first.model)
    verdicts: dict[str, tuple[str, str]] = {}
    for name in names:
        worker = run.inventory.worker(name)
        result = probe_worker(ProbeTarget(name, worker.admin_url, worker.model),
                              run.canary_set, run.inventory.canary)
        verdicts[name] = (result.verdict, result.reason)
    return verdicts


async def _canary(run: DrillRun, probe: Probe) -> tuple[bool, str]:
    names = _probe_workers(run, probe)
    deadline = run.clock.now() + probe.within_s
    while True:
        # A thread: the canary probe blocks, and the load goes on meanwhile.
        verdicts = await asyncio.to_thread(_canary_verdicts, run, names)
        want = probe.expect
        bad = {n: v for n, v in verdicts.items() if (v[0] == "healthy") != (want == "healthy")}
        if not bad:
            return True, "; ".join(f"{n}: {v[0]}" for n, v in verdicts.items())
        if run.clock.now() >= deadline:
            return False, "; ".join(f"{n}: {v[0]} ({v[1]})" for n, v in bad.items())
        await run.clock.asleep(0.2)  # re-probe until the deadline


async def _shed(run: DrillRun, probe: Probe) -> tuple[bool, str]:
    """One request at a time with the probe's priority until the proxy sheds one properly."""
    from dynamo_ftctl.openai import completion_request
    from dynamo_ftctl.proxy.admission import BUSY_BODY

    want = {**BUSY_BODY, "code": 503}
    body = json.dumps(completion_request(run.inventory.workers[0].model, "shed?",
                                         max_tokens=1)).encode()
    headers = {"content-type": "application/json", "x-ftctl-priority": str(probe.priority)}
    deadline = run.clock.now() + probe.within_s
    sent = 0
    last = "no answer"
    client = Client()
    try:
        while run.clock.now() < deadline:
            sent += 1
            try:
                async with asyncio.timeout(_SHED_TIMEOUT_S):
                    response = await client.request("POST", f"{run.target_url}/v1/completions",
                                                    body, headers)
                    async with response:
                        status = response.status
                        retry_after = response.header("retry-after")
                        content = await response.read()
            except (HttpError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if status == 503:
                try:
                    answer = loads(content)
                except ValueError:
                    answer = content.decode(errors="replace")[:200]
                if retry_after is not None and answer == want:
                    return True, (f"{probe.priority}: 503 with Retry-After: {retry_after} and "
                                  f"the busy body (request {sent})")
                last = f"503 with Retry-After {retry_after!r} and body {answer!r}"
            else:
                last = f"HTTP {status}"
            await run.clock.asleep(0.02)  # next try of a condition bounded by the deadline
    finally:
        await client.close()
    return False, f"{probe.priority}: not shed within {probe.within_s:g} s ({sent} sent; {last})"


_CHECKS: dict[str, Callable[[DrillRun, Probe], Awaitable[tuple[bool, str]]]] = {
    "workers_healthy": _workers_healthy, "canary": _canary, "shed": _shed,
}


async def check_probe(run: DrillRun, probe: Probe, phase: str,
                      t_s: float | None = None) -> ProbeOutcome:
    """Ask the cluster one state probe's question; its verdict (logged)."""
    try:
        passed, detail = await _CHECKS[probe.kind](run, probe)
    except FtctlError as exc:
        passed, detail = False, str(exc)
    outcome = ProbeOutcome(probe.name, probe.kind, phase, passed, detail, t_s)
    run.log(f"{phase}: {probe.name}: {'ok' if passed else 'FAILED'} ({detail})")
    return outcome


async def check_probes(run: DrillRun, probes: Sequence[Probe], phase: str) -> list[ProbeOutcome]:
    """The state probes of one phase, one after another."""
    return [await check_probe(run, probe, phase) for probe in probes]


def judge_metric(probe: Probe, counts: dict[str, Any], ttft_p99: float | None) -> ProbeOutcome:
    """A metric probe's verdict on the method's counts (or TTFT p99) against its tolerance."""
    assert probe.max is not None
    if probe.priority is not None:
        tiers = counts.get("by_priority", {})
        if probe.priority not in tiers:
            return ProbeOutcome(probe.name, probe.kind, "after", False,
                                f"no {probe.priority} load in the method")
        counts = tiers[probe.priority]
    value: float | None
    if probe.kind == "ttft_p99_ms":
        value = ttft_p99
    elif probe.kind == "streams_cut_min":
        value = float(counts.get("streams_cut", 0))
        return ProbeOutcome(probe.name, probe.kind, "after", value >= probe.max,
                            f"{value:g} witness streams cut and continued (need ≥ "
                            f"{probe.max:g})")
    elif probe.kind == "rejected_min":
        value = float(counts["rejected"])
        passed = value >= probe.max
        return ProbeOutcome(probe.name, probe.kind, "after", passed,
                            f"{value:g} rejected (need ≥ {probe.max:g})")
    else:
        value = float(counts[probe.kind])
    if value is None:
        return ProbeOutcome(probe.name, probe.kind, "after", False, "no measurement")
    return ProbeOutcome(probe.name, probe.kind, "after", value <= probe.max,
                        f"{value:.4g} (tolerance ≤ {probe.max:g})")


def judge_drained(run: DrillRun, probe: Probe,
                  drained: dict[str, float | None]) -> ProbeOutcome:
    """A `drained_s` probe: each injection's worker was taken out within `max` seconds."""
    assert probe.max is not None
    wanted = [(label, worker) for label, worker, _ in run.injected_at
              if not probe.workers or worker in probe.workers]
    if not wanted:
        return ProbeOutcome(probe.name, probe.kind, "after", False, "no fault was injected")
    slow = [f"{label}: {'not drained' if drained.get(label) is None else drained[label]}"
            for label, _ in wanted
            if drained.get(label) is None or (drained[label] or 0) > probe.max]
    shown = ", ".join(f"{label} {drained.get(label)} s" for label, _ in wanted)
    return ProbeOutcome(probe.name, probe.kind, "after", not slow,
                        (f"drained: {shown}" if not slow else "; ".join(slow))
                        + f" (tolerance ≤ {probe.max:g} s)")


def detections(run: DrillRun, log: Path) -> dict[str, float | None]:
    """Per injection: seconds until the canary daemon took the worker out (weight 0)."""
    if not log.exists():
        return {}
    out: dict[str, float | None] = {}
    transitions = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            transitions.append(loads(line))
    for label, worker, wall in run.injected_at:
        drained = [t["ts"] for t in transitions
                   if t.get("worker") == worker and t.get("weight") == 0 and t["ts"] >= wall]
        out[label] = round(min(drained) - wall, 3) if drained else None
    return out
