"""Run a load: `run_load(config) -> LoadReport`, and `run_load_async` for callers in a loop.

Open loop: the send times are planned before the first request (see
`schedule.py`) and one scheduler task starts each request at its time, never
waiting for earlier answers; a concurrency cap makes requests queue, and the
queueing counts as latency. Closed loop: N users, each sending when its last
answer ended. Every run is bounded by a duration and/or a request count, and
each request by `timeout_s`. Drills watch a run through `on_event` and pass a
`markers` list to which they append `(t, label)` fault markers while it runs
(t in seconds since the run's start, given by the `started` event's `t0`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock, MonotonicClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.loadgen.config import LoadConfig
from dynamo_ftctl.loadgen.record import RequestRecord
from dynamo_ftctl.loadgen.schedule import plan_arrivals, trace_offsets
from dynamo_ftctl.loadgen.stats import LoadSummary, percentile, summarize
from dynamo_ftctl.loadgen.tally import POLL_S, SharedTally
from dynamo_ftctl.loadgen.workload import PromptItem, RequestFactory, RequestSpec, load_prompts

if TYPE_CHECKING:
    from dynamo_ftctl.loadgen.servermetrics import ServerMetrics

__all__ = [
    "LoadEvent",
    "LoadReport",
    "Progress",
    "Sender",
    "describe_config",
    "run_in_fast_loop",
    "run_load",
    "run_load_async",
]

T = TypeVar("T")

class Sender(Protocol):
    """Sends one request and times it (the seam tests replace)."""

    async def send(self, spec: RequestSpec, planned: float, *, warmup: bool,
                   t0: float) -> RequestRecord:
        """Send `spec`; times in the record are seconds since `t0`."""
        ...


@dataclass(frozen=True)
class Progress:
    """A snapshot while a run goes on."""

    t: float
    sent: int
    completed: int
    failed: int
    in_flight: int
    completed_per_s: float
    ttft_p99_ms: float | None


@dataclass(frozen=True)
class LoadEvent:
    """Something a watcher of the run may want: start, progress, abort, end."""

    kind: Literal["started", "progress", "aborted", "finished"]
    t: float
    t0: float
    progress: Progress | None = None
    message: str | None = None


@dataclass(frozen=True)
class LoadReport:
    """A finished run: its summary, every request, the markers, and why it stopped."""

    config: LoadConfig
    summary: LoadSummary
    records: tuple[RequestRecord, ...]
    markers: tuple[tuple[float, str], ...]
    started_at: float
    elapsed_s: float
    model: str | None
    aborted: str | None = None
    # The targets' own counters over the run (`servermetrics.watch_server_metrics`).
    server_metrics: tuple[ServerMetrics, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The JSON summary (`--json`, `summary.json`): numbers first, then the setup."""
        from dynamo_ftctl.output import to_jsonable

        doc: dict[str, Any] = {"kind": "ftctl-load-report"}
        doc.update(to_jsonable(self.summary))
        if self.server_metrics:
            from dynamo_ftctl.loadgen.servermetrics import server_migrations

            doc["server_migrated"] = server_migrations(self.server_metrics)
            doc["server_metrics"] = [m.to_json() for m in self.server_metrics]
        doc["aborted"] = self.aborted
        doc["started_at"] = self.started_at
        doc["elapsed_s"] = self.elapsed_s
        doc["model"] = self.model
        doc["markers"] = [{"t_s": t, "label": label} for t, label in self.markers]
        doc["config"] = describe_config(self.config)
        return doc

    def __rich__(self) -> Any:
        from dynamo_ftctl.loadgen.render import render_report

        return render_report(self)


def describe_config(config: LoadConfig) -> dict[str, Any]:
    """The setup of a run in JSON types."""
    from dynamo_ftctl.output import to_jsonable

    sched = config.schedule
    wl = config.workload
    return {
        "targets": list(config.targets),
        "loop": "open" if sched.open_loop else "closed",
        "rate_per_s": sched.rate,
        "ramp_to_per_s": sched.ramp_to,
        "ramp_steps": sched.ramp_steps,
        "users": sched.users,
        "arrival": sched.arrival if sched.open_loop else None,
        "burstiness": sched.burstiness,
        "concurrency": sched.concurrency,
        "honor_retry_after": sched.honor_retry_after,
        "seed": sched.seed,
        "duration_s": config.duration_s,
        "requests": config.requests,
        "warmup_s": config.warmup_s,
        "timeout_s": config.timeout_s,
        "api": wl.api,
        "stream": wl.stream,
        "prompt_tokens": str(wl.prompt_tokens),
        "max_tokens": str(wl.max_tokens),
        "ignore_eos": wl.ignore_eos,
        "min_tokens": wl.min_tokens,
        "priority": wl.priority,
        "prompt_file": wl.prompt_file,
        "trace": wl.trace,
        "conversations": wl.conversations,
        "turns": wl.turns,
        "slo": to_jsonable(config.slo),
        "abort_error_rate": config.abort_error_rate,
        "spin_us": round(config.spin_s * 1e6),
        "client": config.client,
        "shard": None if config.shard is None else str(config.shard),
        "start_at": config.start_at,
    }


@dataclass
class _Run:
    """Mutable bookkeeping of one run (private to the runner)."""

    config: LoadConfig
    clock: Clock
    t0: float
    on_event: Callable[[LoadEvent], None] | None
    records: list[RequestRecord] = field(default_factory=list)
    sent: int = 0
    failed: int = 0
    in_flight: int = 0
    aborted: str | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tally: SharedTally | None = None  # the whole run's counts under --procs N

    def record(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        if not rec.ok:
            self.failed += 1
        limit = self.config.abort_error_rate
        finished, failed = len(self.records), self.failed
        if self.tally is not None:  # the rule is the run's, across its processes
            finished, failed = self.tally.record(finished, failed)
            if self.look_for_abort():
                return
        if (limit is not None and self.aborted is None
                and finished >= self.config.abort_min_requests
                and failed / finished > limit):
            if self.tally is not None:
                self.tally.abort()
            self._abort(f"error rate {failed / finished:.1%} passed the limit "
                        f"{limit:.1%} after {finished} requests")

    def look_for_abort(self) -> bool:
        """Stop when another process of the run has aborted it; True when one has."""
        by = self.tally.aborted_by() if self.tally is not None else None
        if by is None:
            return False
        if self.aborted is None:  # another process decided
            self._abort(f"load process {by + 1} stopped the run: the run's error rate "
                        f"passed the limit")
        return True

    def _abort(self, why: str) -> None:
        self.aborted = why
        self.stop.set()
        self.emit("aborted", message=why)

    async def watch_tally(self) -> None:
        """Under --procs N: stop soon after another process aborts the run, even while
        this one has nothing finishing (its requests hang, or it waits to send)."""
        while not self.look_for_abort():
            await asyncio.sleep(POLL_S)

    def emit(self, kind: Literal["started", "progress", "aborted", "finished"], *,
             progress: Progress | None = None, message: str | None = None) -> None:
        if self.on_event is not None:
            self.on_event(LoadEvent(kind=kind, t=self.clock.now() - self.t0, t0=self.t0,
                                    progress=progress, message=message))


_gc_depth = 0
# Young-generation collections every this many net allocations during a run (default
# 700): a request allocates a few hundred objects, so the default collects every
# couple of requests.
_GC_GEN0 = 20_000


@contextlib.contextmanager
def _steady_gc() -> Iterator[None]:
    """Keep the cyclic GC out of the send schedule while a run goes on.

    Everything alive before the run (modules, pydantic: hundreds of
    thousands of objects) is frozen out of the collector, so the full collection
    that would otherwise fall in the middle of a run (long enough to be the whole p99
    of schedule lag; docs/benchmarks.md) has only the run's own objects to scan, and
    young collections run less often. Nested runs (a drill's, a sweep's) share
    the outermost setting; everything is restored after.
    """
    global _gc_depth  # noqa: PLW0603 (process-wide collector state, one owner at a time)
    _gc_depth += 1
    if _gc_depth > 1:
        try:
            yield
        finally:
            _gc_depth -= 1
        return
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(threshold[0], _GC_GEN0), *threshold[1:])
    try:
        yield
    finally:
        _gc_depth -= 1
        gc.set_threshold(*threshold)
        gc.unfreeze()


def run_in_fast_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop when it is installed: a client's per-request work
    in the loop costs about half as much (benchmarks/load.py)."""
    box: list[T] = []

    async def keep() -> None:
        # The result leaves through `box`, not as the main task's: restoring SIGINT,
        # asyncio.Runner formats a repr of that task, result and all (every record of
        # a run: ~0.1 s per few thousand requests, measured).
        box.append(await main)

    from dynamo_ftctl.httpapp import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(keep())
    return box[0]


async def _sleep_until(clock: Clock, deadline: float, spin_s: float) -> None:
    """Sleep on a timer until `spin_s` before `deadline`, then yield to the loop until it.

    Timers are late by up to ~1 ms (epoll rounds timeouts up to whole milliseconds)
    and a process woken from idle on a shared VM may wait longer for its CPU; the
    spin (other requests' callbacks still run in it) trades that lag for CPU.
    """
    delay = deadline - clock.now()
    if delay <= 0:
        return
    if not isinstance(clock, MonotonicClock):
        await clock.asleep(delay)  # fake clocks jump straight to the deadline
        return
    if delay > spin_s:
        await clock.asleep(delay - spin_s)
    while clock.now() < deadline:
        await asyncio.sleep(0)


async def _wait_for_wall(clock: Clock, start_at: float, spin_s: float) -> None:
    """Sleep until the wall clock reads `start_at` (at once if it has passed): the common
    start of shards on several machines, each on its own monotonic clock after it."""
    delay = start_at - clock.wall()
    if delay > 0:
        await _sleep_until(clock, clock.now() + delay, spin_s)


async def _open_loop(run: _Run, factory: RequestFactory, sender: Sender,
                     arrivals: Sequence[tuple[int, float]]) -> None:
    config = run.config
    gate = (asyncio.Semaphore(config.schedule.concurrency)
            if config.schedule.concurrency else None)
    tasks: set[asyncio.Task[None]] = set()
    warmup_s = config.warmup_s
    t0 = run.t0

    async def one(spec: RequestSpec, planned: float) -> None:
        run.in_flight += 1
        try:
            if gate is None:
                rec = await sender.send(spec, planned, warmup=planned < warmup_s, t0=t0)
            else:
                async with gate:
                    rec = await sender.send(spec, planned, warmup=planned < warmup_s, t0=t0)
        finally:
            run.in_flight -= 1
        run.record(rec)

    for index, offset in arrivals:
        spec = factory.build(index)
        await _sleep_until(run.clock, t0 + offset, config.spin_s)
        if run.stop.is_set():
            break
        task = asyncio.create_task(one(spec, offset))
        run.sent += 1
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        # Let the new request start (and stamp its send) before planning the next; a
        # scheduler that fell behind still yields once per request, so it can be stopped.
        await asyncio.sleep(0)
    await _drain(run, tasks)


async def _closed_loop(run: _Run, factory: RequestFactory, sender: Sender) -> None:
    config = run.config
    users = config.schedule.users or 1
    numbers = itertools.count()
    if config.shard is not None:  # every N-th request number, an N-th of the users
        users = config.shard.users(users)
        numbers = itertools.count(config.shard.index, config.shard.count)
    clock = run.clock
    t0 = run.t0

    async def user() -> None:
        while not run.stop.is_set():
            index = next(numbers)
            if config.requests is not None and index >= config.requests:
                return
            planned = clock.now() - t0
            if config.duration_s is not None and planned >= config.duration_s:
                return
            spec = factory.build(index)
            run.sent += 1
            run.in_flight += 1
            try:
                rec = await sender.send(spec, planned, warmup=planned < config.warmup_s,
                                        t0=t0)
            finally:
                run.in_flight -= 1
            run.record(rec)
            if honor and rec.retry_after_s:
                await clock.asleep(_backoff(rec.retry_after_s, clock.now() - t0,
                                            config.duration_s))

    honor = config.schedule.honor_retry_after
    tasks = {asyncio.create_task(user()) for _ in range(users)}
    await _drain(run, tasks)


def _backoff(retry_after_s: float, elapsed_s: float, duration_s: float | None) -> float:
    """How long a closed-loop user waits after a shed answer: its Retry-After, cut at the
    end of the run (a user that would wake after it has nothing left to send)."""
    if duration_s is None:
        return retry_after_s
    return max(0.0, min(retry_after_s, duration_s - elapsed_s))


async def _drain(run: _Run, tasks: set[asyncio.Task[None]]) -> None:
    """Wait for the tasks; on abort, cancel what is still in flight."""
    pending: set[asyncio.Future[Any]] = set(tasks)
    stopper: asyncio.Future[Any] = asyncio.ensure_future(run.stop.wait())
    try:
        while pending:
            done, _ = await asyncio.wait({*pending, stopper},
                                         return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if run.stop.is_set():
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return
            for task in done:
                error = task.exception()
                if error is not None:
                    raise error
    finally:
        stopper.cancel()


async def _progress(run: _Run) -> None:
    interval = run.config.progress_interval_s
    seen = 0
    last = run.clock.now()
    while True:
        # Paced by the event loop's own timer: progress must not move a fake clock.
        await asyncio.sleep(interval)
        now = run.clock.now()
        recent = run.records[seen:]
        seen = len(run.records)
        ttfts = sorted(r.ttft_s for r in recent if r.ok and r.ttft_s is not None)
        run.emit("progress", progress=Progress(
            t=now - run.t0, sent=run.sent, completed=len(run.records) - run.failed,
            failed=run.failed, in_flight=run.in_flight,
            completed_per_s=sum(1 for r in recent if r.ok) / max(now - last, 1e-9),
            ttft_p99_ms=percentile(ttfts, 99) * 1000 if ttfts else None,
        ))
        last = now


def _first_model(status: int | None, body: bytes) -> str | None:
    """The first model id of a `GET /v1/models` answer, or None if it will not say."""
    if status != 200:
        return None
    try:
        doc = loads(body)
    except ValueError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model = data[0].get("id")
        return model if isinstance(model, str) else None
    return None


async def _default_sender(config: LoadConfig, clock: Clock, model: str | None,
                          ) -> tuple[Sender, Callable[[], Awaitable[None]], str | None]:
    """The run's client, how to close it, and the model (asked of the first target)."""
    from dynamo_ftctl.loadgen.sender import Http1Sender

    sender = Http1Sender(timeout_s=config.timeout_s, now=clock.now)

    async def close() -> None:
        sender.close()

    if model is None:
        models_url = config.targets[0].rstrip("/") + "/v1/models"
        model = _first_model(*await sender.get(models_url, timeout_s=5.0))
    return sender, close, model


def _plan(config: LoadConfig, items: tuple[PromptItem, ...] | None) -> list[tuple[int, float]]:
    """(request number, planned offset) of this process's arrivals: the whole run's plan,
    computed the same in every shard, of which a shard keeps every N-th."""
    offsets = _plan_all(config, items)
    arrivals = list(enumerate(offsets))
    if config.shard is not None:
        return arrivals[config.shard.index::config.shard.count]
    return arrivals


def _plan_all(config: LoadConfig, items: tuple[PromptItem, ...] | None) -> list[float]:
    if config.workload.trace is not None:
        assert items is not None
        offsets = trace_offsets([it.timestamp or 0.0 for it in items])
        if config.duration_s is not None:
            offsets = [o for o in offsets if o < config.duration_s]
        return offsets[: config.requests] if config.requests is not None else offsets
    return plan_arrivals(config.schedule, duration_s=config.duration_s, count=config.requests)


async def run_load_async(
    config: LoadConfig, *,
    on_event: Callable[[LoadEvent], None] | None = None,
    markers: list[tuple[float, str]] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    sender: Sender | None = None,
    tally: SharedTally | None = None,
) -> LoadReport:
    """Run `config` in the running event loop and return its report (`tally`: the
    counts this process shares with the others of a --procs run)."""
    wl = config.workload
    items: tuple[PromptItem, ...] | None = None
    if wl.trace is not None:
        items = load_prompts(wl.trace, trace=True)
    elif wl.prompt_file is not None:
        items = load_prompts(wl.prompt_file, trace=False)
    if wl.trace is not None and not config.schedule.open_loop:
        msg = "trace: a trace replays its own timestamps; use it with an open-loop rate"
        raise InvalidInput(msg)
    arrivals = _plan(config, items) if config.schedule.open_loop or wl.trace else []
    close: Callable[[], Awaitable[None]] | None = None
    model = wl.model
    if sender is None:
        sender, close, model = await _default_sender(config, clock, model)
    factory = RequestFactory(wl, config.targets, seed=config.schedule.seed, model=model,
                             items=items)
    if config.start_at is not None:
        await _wait_for_wall(clock, config.start_at, config.spin_s)
    with _steady_gc():
        started_at = clock.wall()
        run = _Run(config=config, clock=clock, t0=clock.now(), on_event=on_event,
                   tally=tally)
        run.emit("started")
        ticker = asyncio.create_task(_progress(run)) if on_event is not None else None
        watcher = (asyncio.create_task(run.watch_tally())
                   if tally is not None and config.abort_error_rate is not None else None)
        try:
            if config.schedule.open_loop:
                await _open_loop(run, factory, sender, arrivals)
            else:
                await _closed_loop(run, factory, sender)
        finally:
            for task in (ticker, watcher):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if close is not None:
                await close()
        elapsed = clock.now() - run.t0
    records = tuple(sorted(run.records, key=lambda r: r.index))
    planned = (sum(1 for _, o in arrivals if o >= config.warmup_s)
               if config.schedule.open_loop
               else sum(1 for r in records if not r.warmup))
    summary = summarize(records, slo=config.slo, measure_from=config.warmup_s,
                        planned_requests=planned)
    report = LoadReport(
        config=config, summary=summary, records=records,
        markers=tuple(sorted(markers or ())), started_at=started_at, elapsed_s=elapsed,
        model=model, aborted=run.aborted,
    )
    run.emit("finished")
    return report


def run_load(config: LoadConfig, *,
             on_event: Callable[[LoadEvent], None] | None = None,
             markers: list[tuple[float, str]] | None = None,
             tally: SharedTally | None = None) -> LoadReport:
    """Run `config` to completion in a new event loop (uvloop when installed)."""
    return run_in_fast_loop(run_load_async(config, on_event=on_event, markers=markers,
                                           tally=tally))

