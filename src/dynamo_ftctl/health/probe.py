"""Canary probes: send a set to a worker, judge every answer, return a `ProbeResult`.

`probe_worker` is the one-shot probe (Kubernetes exec probes, cron): blocking,
a plain socket parsed by httptools underneath, the latency baseline read and
updated in the shared state file. `aprobe_worker` is the same probe for the daemon (the shared http1
client, the baseline in memory). Both retry transient errors (a connection lost mid-answer)
`max_retries` times; a refusal or a timeout is a verdict, not retried, so a dead
or hung worker costs one timeout, not three.

Verdicts: `healthy` (exit 0); `unhealthy` (exit 1: wrong tokens or text, logit
drift, latency spike, a garbage answer; with a shape set: an empty answer, a
finish reason or token count off the recorded shape, a slow answer);
`unreachable` (exit 3: refused, reset, no answer within the timeout).
`ProbeReport` folds several workers into one exit code: 1 if any answered
wrongly, else 3 if any did not answer, else 0. It names the kind of set that
judged (`set_kind`, with its `set_note`): a shape set's healthy verdict says the
worker is alive and answering, not that its answers are right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import ExitCode, InvalidInput
from dynamo_ftctl.health.baseline import Baselines, BaselineStore, LatencyVerdict
from dynamo_ftctl.health.canaryset import EXACT_NOTE, SHAPE_NOTE, CanaryPrompt, CanarySet
from dynamo_ftctl.health.errors import BadResponse
from dynamo_ftctl.health.judge import (
    CheckKind,
    Mismatch,
    Timing,
    Verdict,
    build_request,
    judge_answer,
    judge_shape,
    parse_answer,
)
from dynamo_ftctl.health.transport import (
    Http1Transport,
    TransportError,
    apost_json,
    post_json,
)

if TYPE_CHECKING:
    from dynamo_ftctl.http1.transport import AsyncTransport, Reply, Transport
    from dynamo_ftctl.inventory.canary import CanaryConfig

__all__ = [
    "ProbeReport",
    "ProbeResult",
    "ProbeTarget",
    "PromptCheck",
    "aprobe_worker",
    "probe_worker",
    "probe_workers",
]

ProbeVerdict = Literal["healthy", "unhealthy", "unreachable"]
_BACKOFF_S = 0.05


class ProbeTarget(msgspec.Struct, frozen=True):
    """A worker to probe: its name (the baseline key), base URL and served model."""

    name: str
    url: str
    model: str | None = None


class PromptCheck(msgspec.Struct, frozen=True):
    """One prompt's outcome."""

    prompt: str
    kind: CheckKind
    reason: str
    latency_s: float | None
    attempts: int
    mismatch: Mismatch | None = None
    top_logprob: float | None = None
    ttft_s: float | None = None  # shape sets: seconds to the first streamed byte

    @property
    def ok(self) -> bool:
        """True when the answer matched."""
        return self.kind == "ok"


class ProbeResult(msgspec.Struct, frozen=True):
    """One worker's verdict."""

    worker: str
    url: str
    verdict: ProbeVerdict
    kind: CheckKind
    reason: str
    latency_s: float | None
    baseline_s: float | None
    wall_s: float
    checks: tuple[PromptCheck, ...]
    mismatch: Mismatch | None = None

    @property
    def healthy(self) -> bool:
        """True for a healthy verdict."""
        return self.verdict == "healthy"

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 unhealthy, 3 unreachable."""
        return {"healthy": ExitCode.OK, "unhealthy": ExitCode.FAILED,
                "unreachable": ExitCode.UNREACHABLE}[self.verdict]


class ProbeReport(msgspec.Struct, frozen=True):
    """The verdicts of one `ftctl canary` run."""

    results: tuple[ProbeResult, ...]
    wall_s: float
    canary_set: str
    state_file: str | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    set_kind: Literal["exact", "shape"] = "exact"

    @property
    def set_note(self) -> str:
        """What the kind of set that judged can tell."""
        return SHAPE_NOTE if self.set_kind == "shape" else EXACT_NOTE

    @property
    def exit_code(self) -> int:
        """1 if any worker answered wrongly, else 3 if any did not answer, else 0."""
        verdicts = {r.verdict for r in self.results}
        if "unhealthy" in verdicts:
            return int(ExitCode.FAILED)
        if "unreachable" in verdicts:
            return int(ExitCode.UNREACHABLE)
        return int(ExitCode.OK)

    def to_json(self) -> dict[str, Any]:
        from dynamo_ftctl.output import to_jsonable

        return {
            "healthy": self.exit_code == 0, "exit_code": self.exit_code,
            "wall_s": round(self.wall_s, 4), "canary_set": self.canary_set,
            "set_kind": self.set_kind, "set_note": self.set_note,
            "state_file": self.state_file,
            "workers": [to_jsonable(r) for r in self.results],
        }

    _HEADERS = ("worker", "verdict", "latency", "baseline", "reason")

    def _rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for r in self.results:
            latency = f"{r.latency_s * 1000:.0f} ms" if r.latency_s is not None else "-"
            baseline = f"{r.baseline_s * 1000:.0f} ms" if r.baseline_s is not None else "-"
            rows.append((r.worker, r.verdict.upper(), latency, baseline, r.reason))
        return rows

    def _footer(self) -> str:
        word = {0: "healthy", 1: "unhealthy", 3: "unreachable"}[self.exit_code]
        return (f"{word} (exit {self.exit_code}) in {self.wall_s * 1000:.0f} ms, "
                f"judged by {'an' if self.set_kind == 'exact' else 'a'} {self.set_kind} set "
                f"({self.set_note})")

    def plain_text(self) -> str:
        """Aligned columns without rich: what probes and cron capture (no terminal)."""
        from dynamo_ftctl.output import plain_table

        return plain_table(self._HEADERS, self._rows()) + self._footer() + "\n"

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        from dynamo_ftctl.output import table

        out = table(None, list(self._HEADERS), self._rows(), styles={"verdict": "bold"})
        return Group(out, Text(self._footer()))


# ---------------------------------------------------------------------------
# Shared steps


def _check_model(target: ProbeTarget, canary_set: CanarySet) -> None:
    if target.model is not None and target.model != canary_set.model:
        msg = (f"worker {target.name!r} serves {target.model!r} but the canary set is for "
               f"{canary_set.model!r}; pass --set with the right set")
        raise InvalidInput(msg)


def _judge(canary_set: CanarySet, prompt: CanaryPrompt, reply: Reply, latency: float,
           ) -> tuple[Verdict, float | None]:
    try:
        answer = parse_answer(reply)
    except BadResponse as exc:
        return Verdict("bad_response", str(exc)), None
    if canary_set.kind == "shape":
        return judge_shape(prompt, answer, _timing(reply, latency), canary_set.tolerance), \
            answer.top_logprob
    return judge_answer(prompt, answer), answer.top_logprob


def _timing(reply: Reply, latency: float) -> Timing:
    """The answer's TTFT (its first body byte; the whole answer when the transport cannot
    tell) and its latency."""
    first = reply.first_byte_s
    return Timing(latency if first is None else min(first, latency), latency)


def _failed_transport(prompt: CanaryPrompt, exc: TransportError, attempts: int) -> PromptCheck:
    kind: CheckKind = "unreachable" if exc.unreachable else "bad_response"
    return PromptCheck(prompt.name, kind, exc.message, None, attempts)


def _conclude(
    target: ProbeTarget, checks: list[PromptCheck], wall_s: float, baselines: Baselines | None,
    config: CanaryConfig,
) -> ProbeResult:
    """The verdict of one probe; `baselines` None: no latency judgement (`--no-state`)."""
    failed = next((c for c in checks if not c.ok), None)
    if failed is not None:
        verdict: ProbeVerdict = "unreachable" if failed.kind == "unreachable" else "unhealthy"
        entry = baselines.entries.get(target.name) if baselines is not None else None
        return ProbeResult(
            target.name, target.url, verdict, failed.kind, f"{failed.prompt}: {failed.reason}",
            _set_latency(checks, config), entry.ema_s if entry else None, wall_s,
            tuple(checks), failed.mismatch,
        )
    latency = _set_latency(checks, config) or 0.0
    if baselines is None:
        return ProbeResult(target.name, target.url, "healthy", "ok",
                           f"{len(checks)} prompts ok (no latency baseline)", latency, None,
                           wall_s, tuple(checks))
    judged: LatencyVerdict = baselines.judge(target.name, latency, config.latency_spike_factor)
    if judged.spike:
        return ProbeResult(target.name, target.url, "unhealthy", "latency_spike", judged.reason,
                           latency, judged.baseline_s, wall_s, tuple(checks))
    baselines.update(target.name, latency, config.ema_alpha)
    reason = f"{len(checks)} prompts ok"
    if judged.baseline_s is None:
        reason += " (latency baseline building)"
    return ProbeResult(target.name, target.url, "healthy", "ok", reason, latency,
                       judged.baseline_s, wall_s, tuple(checks))


def _set_latency(checks: Sequence[PromptCheck], config: CanaryConfig) -> float | None:
    """The set's latency: its slowest answer when sent at once, else the sum of answers."""
    latencies = [c.latency_s for c in checks if c.latency_s is not None]
    if not latencies:
        return None
    return max(latencies) if config.parallel_prompts else sum(latencies)


def _timeout(prompt: CanaryPrompt, config: CanaryConfig) -> float:
    return prompt.timeout_s if prompt.timeout_s is not None else config.timeout_s


# Answers that say "try again shortly": retried like a transient transport error.
_RETRY_STATUSES = frozenset((429, 502, 503, 504))


def _retry_wait(retryable: bool, attempts: int, config: CanaryConfig) -> float | None:
    """Seconds to back off before another attempt, or None when the answer stands."""
    if not retryable or attempts > config.max_retries:
        return None
    return float(_BACKOFF_S * 2 ** (attempts - 1))


# Request bodies encoded once per set and prompt, not once per request: the daemon
# sends the same 3 bodies 10,000 times a round. Keyed by identity, the set and prompt
# kept alive beside their bytes so that an id is never reused while cached.
_BUILT: dict[int, tuple[CanarySet, CanaryPrompt, tuple[str, bytes]]] = {}
_MAX_BUILT = 1024


def _request(canary_set: CanarySet, prompt: CanaryPrompt) -> tuple[str, bytes]:
    """`build_request(canary_set, prompt)`, remembered."""
    hit = _BUILT.get(id(prompt))
    if hit is not None and hit[0] is canary_set and hit[1] is prompt:
        return hit[2]
    built = build_request(canary_set, prompt)
    if len(_BUILT) >= _MAX_BUILT:
        _BUILT.clear()
    _BUILT[id(prompt)] = (canary_set, prompt, built)
    return built


def _checked(canary_set: CanarySet, prompt: CanaryPrompt, reply: Reply, latency: float,
             attempts: int) -> PromptCheck:
    verdict, top = _judge(canary_set, prompt, reply, latency)
    ttft = _timing(reply, latency).ttft_s if canary_set.kind == "shape" else None
    return PromptCheck(prompt.name, verdict.kind, verdict.reason, latency, attempts,
                       verdict.mismatch, top, ttft)


# ---------------------------------------------------------------------------
# One-shot (blocking)


def _probe_prompt(
    target: ProbeTarget, canary_set: CanarySet, prompt: CanaryPrompt, config: CanaryConfig, *,
    transport: Transport, clock: Clock,
) -> PromptCheck:
    path, body = build_request(canary_set, prompt)
    tries = _Attempts(canary_set, prompt, config, clock)
    while True:
        outcome: Reply | TransportError
        try:
            outcome = post_json(transport, target.url + path, body, timeout_s=tries.begin())
        except TransportError as exc:
            outcome = exc
        if isinstance(step := tries.after(outcome), PromptCheck):
            return step
        clock.sleep(step)


class _Attempts:
    """One prompt's attempts, for the blocking and the async loop alike: `begin` before
    each (its timeout), `after` with its outcome (the check, or seconds to wait)."""

    __slots__ = ("_clock", "_config", "_prompt", "_set", "_start", "count")

    def __init__(self, canary_set: CanarySet, prompt: CanaryPrompt, config: CanaryConfig,
                 clock: Clock) -> None:
        self._set, self._prompt, self._config, self._clock = canary_set, prompt, config, clock
        self._start = 0.0
        self.count = 0

    def begin(self) -> float:
        self.count += 1
        self._start = self._clock.now()
        return _timeout(self._prompt, self._config)

    def after(self, outcome: Reply | TransportError) -> PromptCheck | float:
        return _after_attempt(self._set, self._prompt, self._config, attempts=self.count,
                              outcome=outcome, latency=self._clock.now() - self._start)


def _after_attempt(canary_set: CanarySet, prompt: CanaryPrompt, config: CanaryConfig, *,
                   attempts: int, outcome: Reply | TransportError, latency: float,
                   ) -> PromptCheck | float:
    """What one attempt leads to: the prompt's check, or the seconds to wait before the
    next attempt (a transient transport error or a retryable status, within the budget)."""
    if isinstance(outcome, TransportError):
        wait = _retry_wait(outcome.transient, attempts, config)
        return _failed_transport(prompt, outcome, attempts) if wait is None else wait
    wait = _retry_wait(outcome.status in _RETRY_STATUSES, attempts, config)
    return _checked(canary_set, prompt, outcome, latency, attempts) if wait is None else wait


def _run_prompts_sync(
    target: ProbeTarget, canary_set: CanarySet, config: CanaryConfig,
    transport: Transport, clock: Clock,
) -> list[PromptCheck]:
    def probe(prompt: CanaryPrompt) -> PromptCheck:
        return _probe_prompt(target, canary_set, prompt, config, transport=transport, clock=clock)

    if config.parallel_prompts and len(canary_set.prompts) > 1:
        return _in_threads(probe, canary_set.prompts)
    checks: list[PromptCheck] = []
    for prompt in canary_set.prompts:
        checks.append(probe(prompt))
        if checks[-1].kind == "unreachable":
            break  # a dead or hung worker costs one timeout, not one per prompt
    return checks


def _in_threads(probe: Callable[[CanaryPrompt], PromptCheck],
                prompts: Sequence[CanaryPrompt]) -> list[PromptCheck]:
    """`probe` every prompt at once: the first in this thread, the others in their own."""
    import threading

    checks: list[PromptCheck | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            checks[index] = probe(prompts[index])
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(1, len(prompts))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [check for check in checks if check is not None]


def probe_worker(
    target: ProbeTarget, canary_set: CanarySet, config: CanaryConfig, *,
    transport: Transport | None = None, clock: Clock = SYSTEM_CLOCK,
    store: BaselineStore | None = None,
) -> ProbeResult:
    """Probe one worker once (blocking); the baseline lives in `store` when given."""
    return probe_workers([target], canary_set, config, transport=transport, clock=clock,
                         store=store).results[0]


def probe_workers(
    targets: Sequence[ProbeTarget], canary_set: CanarySet, config: CanaryConfig, *,
    transport: Transport | None = None, clock: Clock = SYSTEM_CLOCK,
    store: BaselineStore | None = None, set_name: str = "",
) -> ProbeReport:
    """Probe workers one after another; the state file is locked only to judge latency."""
    for target in targets:
        _check_model(target, canary_set)
    transport = transport or Http1Transport()
    started = clock.now()
    results = []
    for target in targets:
        begin = clock.now()
        checks = _run_prompts_sync(target, canary_set, config, transport, clock)
        wall = clock.now() - begin
        if store is None:
            results.append(_conclude(target, checks, wall, None, config))
            continue
        # Hold the lock only for the read-judge-update-write, never across requests.
        with store.locked() as baselines:
            results.append(_conclude(target, checks, wall, baselines, config))
    return ProbeReport(tuple(results), clock.now() - started,
                       set_name, str(store.path) if store else None, set_kind=canary_set.kind)


# ---------------------------------------------------------------------------
# Daemon (async)


async def _aprobe_prompt(
    target: ProbeTarget, canary_set: CanarySet, prompt: CanaryPrompt, config: CanaryConfig, *,
    transport: AsyncTransport, clock: Clock,
) -> PromptCheck:
    path, body = _request(canary_set, prompt)
    tries = _Attempts(canary_set, prompt, config, clock)
    while True:
        outcome: Reply | TransportError
        try:
            outcome = await apost_json(transport, target.url + path, body,
                                       timeout_s=tries.begin())
        except TransportError as exc:
            outcome = exc
        if isinstance(step := tries.after(outcome), PromptCheck):
            return step
        await clock.asleep(step)


async def aprobe_worker(
    target: ProbeTarget, canary_set: CanarySet, config: CanaryConfig, *,
    transport: AsyncTransport, baselines: Baselines, clock: Clock = SYSTEM_CLOCK,
) -> ProbeResult:
    """Probe one worker once (the daemon); `baselines` is updated in memory."""
    begin = clock.now()
    if config.parallel_prompts and len(canary_set.prompts) > 1:
        import asyncio

        # The first prompt in this task, the others in their own (no gather: a task and
        # a future fewer per probe, 10,000 probes a round).
        first, *rest = (_aprobe_prompt(target, canary_set, prompt, config,
                                       transport=transport, clock=clock)
                        for prompt in canary_set.prompts)
        others = [asyncio.ensure_future(coro) for coro in rest]
        try:
            checks = [await first]
            checks.extend([await task for task in others])
        finally:
            for task in others:
                task.cancel()  # only those still running: an error or a cancellation above
    else:
        checks = []
        for prompt in canary_set.prompts:
            checks.append(await _aprobe_prompt(target, canary_set, prompt, config,
                                               transport=transport, clock=clock))
            if checks[-1].kind == "unreachable":
                break
    return _conclude(target, checks, clock.now() - begin, baselines, config)
