"""The method: load, the timeline of faults and probes, and the witness streams, in one loop.

The load generator (`run_load_async`) runs every load profile at once; the
timeline starts when the first request goes out and injects each fault through
`faults.inject` (so the allowlist, audit log and revert records apply) in a
thread, since an injection with a duration waits while the load must go on.
Meanwhile a poller records each worker's /health state for the report's
timeline, and the witness streams (`drill.witness`) go through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING

from dynamo_ftctl.drill.hypothesis import check_probe
from dynamo_ftctl.drill.report import placement_text
from dynamo_ftctl.drill.state import TimelineEvent
from dynamo_ftctl.errors import FtctlError
from dynamo_ftctl.http1 import Client, HttpError
from dynamo_ftctl.jsoncodec import loads

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from dynamo_ftctl.drill.scenario import LoadProfile, TimelineEntry
    from dynamo_ftctl.drill.state import DrillRun
    from dynamo_ftctl.drill.witness import WitnessStream
    from dynamo_ftctl.loadgen.config import LoadConfig
    from dynamo_ftctl.loadgen.runner import LoadReport

__all__ = ["run_method"]

_POLL_S = 0.2  # worker-state sampling period for the timeline
_WITNESS_WAIT_S = 60.0  # the most a `witness_tokens` fault waits for the streams


async def run_method(run: DrillRun) -> list[tuple[LoadProfile, LoadReport]]:
    """The timeline over every load profile at once; each profile's report."""
    from dynamo_ftctl.loadgen.runner import LoadEvent, run_load_async

    method = run.scenario.method
    started = asyncio.Event()
    stop = asyncio.Event()
    markers: list[tuple[float, str]] = []
    client = Client()  # the poller's and the proxy's /metrics requests
    poller = asyncio.ensure_future(_poll_states(run, client, started, stop))
    try:
        profiles = method.profiles
        if not profiles:
            run.t0 = run.clock.now()
            started.set()
            await _timeline(run, started, markers)
            await run.clock.asleep(method.settle_s)
            return []

        def on_event(event: LoadEvent) -> None:
            if event.kind == "started" and not started.is_set():
                run.t0 = event.t0
                started.set()

        via_proxy = any(p.via == "proxy" for p in profiles)
        timeline = asyncio.ensure_future(_timeline(run, started, markers))
        witnesses = (asyncio.ensure_future(_witness(run, started))
                     if method.witness is not None else None)
        migrations_before = await _proxy_migrations(client, run.target_url) if via_proxy else None
        try:
            # Only the first profile carries the fault markers (one plot timeline).
            reports = await asyncio.gather(*(
                run_load_async(_load_config(run, p), on_event=on_event,
                               markers=markers if i == 0 else [])
                for i, p in enumerate(profiles)))
            if witnesses is not None:
                run.witnesses = await witnesses
                await _compare_witnesses(run, client, run.witnesses)
            if migrations_before is not None:
                after = await _proxy_migrations(client, run.target_url)
                if after is not None:
                    run.proxy_migrations = int(after - migrations_before)
            await asyncio.wait_for(timeline, timeout=max(5.0, run.scenario.timeout_s))
        finally:
            timeline.cancel()
            if witnesses is not None:
                witnesses.cancel()
        await run.clock.asleep(method.settle_s)
        return list(zip(profiles, reports, strict=True))
    finally:
        stop.set()
        await poller
        await client.close()


def _load_config(run: DrillRun, load: LoadProfile) -> LoadConfig:
    from dynamo_ftctl.loadgen.config import Length, LoadConfig, Schedule, Workload

    targets = ((run.target_url,) if load.via == "proxy"
               else tuple(w.url for w in run.inventory.workers))
    return LoadConfig(
        targets=targets,
        # Closed-loop users wait out a shed answer's Retry-After, as clients do: without
        # it every refused user asked again at once (5,000 refusals/s on two cores).
        schedule=Schedule(rate=load.open_rate, users=load.users, arrival="poisson",
                          seed=load.seed, concurrency=load.concurrency,
                          honor_retry_after=load.users is not None),
        workload=Workload(model=run.inventory.workers[0].model,
                          prompt_tokens=Length.fixed(load.prompt_tokens),
                          max_tokens=Length.fixed(load.max_tokens), stream=load.stream,
                          ignore_eos=True, priority=load.priority),
        duration_s=load.duration_s, timeout_s=load.timeout_s,
    )


# ---------------------------------------------------------------------------
# the timeline


async def _timeline(run: DrillRun, started: asyncio.Event,
                    markers: list[tuple[float, str]]) -> None:
    await started.wait()
    assert run.t0 is not None
    entries = sorted(run.scenario.method.timeline, key=lambda e: e.at_s)
    timed: list[asyncio.Future[None]] = []  # injections that revert themselves later
    for entry in entries:
        await run.clock.asleep(run.t0 + entry.at_s - run.clock.now())
        t = run.clock.now() - run.t0
        if entry.probe is not None:
            outcome = await check_probe(run, entry.probe, "during", t)
            run.probes.append(outcome)
            label = f"probe {entry.probe.name}"
            run.events.append(TimelineEvent(round(t, 3), label,
                                            "ok" if outcome.passed else "failed"))
            continue
        label = f"{entry.fault} {entry.worker}"
        if entry.witness_tokens is not None:
            await _await_witness_tokens(run, entry.witness_tokens, label, entry.worker)
            t = run.clock.now() - run.t0
            streams = run.live_witnesses or []
            note = "; witness streams: " + _placement_line(streams, entry.worker)
            if entry.worker and not any(s.worker == entry.worker for s in streams):
                note += "; the proxy's view: " + await _proxy_view(run)
        else:
            note = ""
        markers.append((t, label))
        run.injected_at.append((label, entry.worker or "", run.clock.wall()))
        # Thread: an injection with a duration waits, and the load must go on meanwhile.
        task = asyncio.to_thread(_inject, run, entry)
        if entry.duration_s is not None:
            timed.append(asyncio.ensure_future(_record(run, t, label, task, note)))
        else:
            await _record(run, t, label, task, note)
        run.log(f"t={t:.2f}s {label}")
    await asyncio.gather(*timed)


def _inject(run: DrillRun, entry: TimelineEntry) -> str:
    from dynamo_ftctl.faults.inject import InjectOptions, plan_injection, run_injection
    from dynamo_ftctl.faults.injectors import Injectors

    assert entry.fault is not None
    assert entry.worker is not None
    options = InjectOptions(
        pid=run.pids.get(entry.worker), delay_ms=entry.delay_ms, jitter_ms=entry.jitter_ms,
        after_tokens=entry.after_tokens, rate_kbps=entry.rate_kbps, duration_s=entry.duration_s,
        kmsg_path=run.out_dir / "kmsg.log" if run.local else None,
    )
    plan = plan_injection(run.inventory, entry.worker, entry.fault, options)
    result = run_injection(plan, injectors=Injectors(environ={**os.environ, **run.env}),
                           audit_log=run.out_dir / "audit.jsonl",
                           state_dir=run.out_dir / "state", clock=run.clock)
    return "; ".join(result.outcomes) + ("; reverted" if result.reverted else "")


async def _record(run: DrillRun, t: float, label: str, task: Awaitable[str],
                  note: str = "") -> None:
    try:
        result = await task
    except FtctlError as exc:
        result = f"failed: {exc}"
    run.events.append(TimelineEvent(round(t, 3), label, result + note))


async def _poll_states(run: DrillRun, client: Client, started: asyncio.Event,
                       stop: asyncio.Event) -> None:
    await started.wait()
    assert run.t0 is not None

    async def one(name: str, url: str) -> tuple[str, str]:
        try:
            status, _ = await client.fetch("GET", f"{url}/health", timeout_s=_POLL_S * 2)
        except (HttpError, TimeoutError):
            return name, "down"
        return name, "up" if status == 200 else f"http {status}"

    while not stop.is_set():
        t = run.clock.now() - run.t0
        results = await asyncio.gather(*(one(w.name, w.admin_url)
                                         for w in run.inventory.workers))
        run.states.extend((round(t, 3), name, state) for name, state in results)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _POLL_S)


async def _proxy_migrations(client: Client, url: str) -> float | None:
    """The proxy's `ftctl_migrations_total`, summed over labels (None: no proxy answer).

    Streams learn of their migration only in a trailing SSE comment, which the load
    generator does not read, so the drill counts migrations where they happen.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        _, body = await client.fetch("GET", f"{url}/metrics", timeout_s=2.0)
    except (HttpError, TimeoutError):
        return None
    total = 0.0
    for family in text_string_to_metric_families(body.decode(errors="replace")):
        if family.name == "ftctl_migrations":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


# ---------------------------------------------------------------------------
# the witness streams


async def _witness(run: DrillRun, started: asyncio.Event) -> list[WitnessStream]:
    """The witness streams through the proxy, from `witness.at_s` into the load."""
    from dynamo_ftctl.drill.witness import new_witnesses, run_witnesses

    witness = run.scenario.method.witness
    assert witness is not None
    streams = new_witnesses(witness, run.inventory.workers[0].model)
    await started.wait()
    assert run.t0 is not None
    await run.clock.asleep(run.t0 + witness.at_s - run.clock.now())
    run.log(f"t={run.clock.now() - run.t0:.2f}s {witness.streams} witness streams")
    run.live_witnesses = streams
    await run_witnesses(witness, run.target_url, streams)
    return streams


async def _await_witness_tokens(run: DrillRun, tokens: int, label: str,
                                worker: str | None) -> None:
    """Wait until the witness streams on `worker` (every one when the fault names none)
    have `tokens` token ids or ended, at most `_WITNESS_WAIT_S`: the fault lands while
    they are mid-stream, however slow the engine's first token.

    Only the fault's worker's streams count: waiting for every stream would let those
    on a fast worker finish while those on a slow one start, and the fault then cuts
    none.
    """
    deadline = run.clock.now() + _WITNESS_WAIT_S
    while run.clock.now() < deadline:
        streams = run.live_witnesses
        if streams and _witnesses_ready(streams, tokens, worker):
            return
        await run.clock.asleep(0.01)
    run.log(f"{label}: the witness streams did not reach {tokens} tokens within "
            f"{_WITNESS_WAIT_S:g} s; injecting anyway")


def _witnesses_ready(streams: list[WitnessStream], tokens: int, worker: str | None) -> bool:
    """The streams on `worker` that the proxy has answered have `tokens` ids or ended,
    and either every stream is answered or one on `worker` has used half its
    `max_tokens` (every stream, all answered, when the fault names no worker).

    A stream the proxy has not answered yet may still be on its way to `worker` (a
    loaded machine sends and answers 78 streams over seconds): the fault waits for it,
    so that it cuts as many as it can, but only until `worker`'s first streams are
    half done, so that a slow worker's streams never hold a kill of the fast one until
    its streams have ended. With none answered on `worker`, the fault waits until
    every stream is answered (then none is there).
    """
    answered = [s for s in streams if s.worker is not None or s.ids or s.finished or s.error]
    mine = [s for s in answered if worker is None or s.worker in (worker, None)]
    if not all(len(s.ids) >= tokens or s.finished or s.error for s in mine):
        return False
    if len(answered) == len(streams):
        return True
    if worker is None or not mine:
        return False
    return any(s.finished or len(s.ids) >= _max_tokens(s) // 2 for s in mine)


def _max_tokens(stream: WitnessStream) -> int:
    """The stream's `max_tokens` (0 when its body has none)."""
    limit = stream.body.get("max_tokens")
    return limit if isinstance(limit, int) else 0


def _placement_line(streams: list[WitnessStream], worker: str | None) -> str:
    """Where the witness streams are when a fault lands, for the report: a kill of a
    worker none of them is on cuts none, and this line is what says why."""
    from dynamo_ftctl.drill.witness import placement

    where = placement_text(placement(streams)) or "not started"
    if worker is None:
        return where
    on = sum(1 for s in streams if s.worker == worker and not s.finished)
    return f"{on} of {len(streams)} mid-stream on {worker} ({where})"


async def _proxy_view(run: DrillRun) -> str:
    """The proxy's routing state of each worker (its /health), for a report that must
    say why no witness stream went to the worker a fault is about."""

    client = Client()
    try:
        _, body = await client.fetch("GET", f"{run.target_url}/health", timeout_s=2.0)
        workers = loads(body)["workers"]
        return ", ".join(f"{name} weight {w['weight']} breaker {w['breaker']} busy "
                         f"{w['busy']} outstanding {w['outstanding']}"
                         for name, w in workers.items())
    except (HttpError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    finally:
        await client.close()


async def _healthy_worker(run: DrillRun, client: Client) -> str | None:
    """The admin URL of the first worker that answers /health 200, if any."""
    for worker in run.inventory.workers:
        with contextlib.suppress(HttpError, TimeoutError):
            status, _ = await client.fetch("GET", f"{worker.admin_url}/health", timeout_s=2.0)
            if status == 200:
                return worker.admin_url
    return None


async def _compare_witnesses(run: DrillRun, client: Client,
                             streams: list[WitnessStream]) -> None:
    """The fault-free run of each witness, straight from a healthy worker (admin URL)."""
    from dynamo_ftctl.drill.witness import compare_witnesses

    witness = run.scenario.method.witness
    assert witness is not None
    url = await _healthy_worker(run, client)
    if url is None:
        run.log("witness: no healthy worker for the fault-free run")
        return
    await compare_witnesses(witness, streams, url)
