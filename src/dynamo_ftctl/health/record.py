"""`ftctl canary record`: capture a canary set from a worker known to be good.

Each prompt is sent `repeats` times at temperature 0; the recording is refused
(`CheckFailed`, exit 1) when the answers disagree, because a golden answer that
is not reproducible would flag healthy workers. The top-logprob range is the
observed range widened by `LOGPROB_MARGIN` (float noise across batch shapes and
kernels moves logprobs a little without changing the argmax).

A worker whose greedy answers do not repeat (Dynamo's mocker, a server reusing
cached prefixes) gets a shape set instead (`record_shape_set`, `--shape`): each
prompt is streamed `samples` times and the set keeps the shape of its answers:
the finish reasons seen, the token-count range (widened by `TOKEN_MARGIN` of its
top when an answer stopped early, since a stop may come anywhere), and the
slowest time to first token and whole answer (at least `MIN_BASELINE_S`), which
probes allow `latency_tolerance` times over. Every answer must be usable and
non-empty, or nothing is recorded.

Before recording, one warm-up request runs with its own, generous deadline
(`warmup_timeout_s`): a freshly started engine answers its first request late
(vLLM took over 20 s while compiling), and the per-request timeout is meant
for a warm worker.

Requests ask for token ids (vLLM's `return_token_ids`). A server that refuses
the field (a 400 or 422 naming it: Hugging Face `transformers serve` answers
422 "Unexpected fields") is asked again without it, and the set is recorded
with `return_token_ids: false` and golden text only: its probes then compare
text, not ids. A server that takes the field and returns no ids gets the same
text-only prompts.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import CheckFailed, Unreachable
from dynamo_ftctl.health.canaryset import (
    DEFAULT_LATENCY_TOLERANCE,
    SHAPE_NOTE,
    CanaryPrompt,
    CanarySet,
)
from dynamo_ftctl.health.errors import BadResponse, TokenIdsRefused
from dynamo_ftctl.health.judge import Answer, build_request, parse_answer
from dynamo_ftctl.health.transport import Http1Transport, TransportError, post_json
from dynamo_ftctl.structs import convert_struct, replace

if TYPE_CHECKING:
    from dynamo_ftctl.health.probe import ProbeTarget
    from dynamo_ftctl.http1.transport import Transport

__all__ = ["DEFAULT_PROMPTS", "DEFAULT_SAMPLES", "DEFAULT_WARMUP_TIMEOUT_S", "LOGPROB_MARGIN",
           "MIN_BASELINE_S", "TOKEN_MARGIN", "record_canary_set", "record_shape_set"]

LOGPROB_MARGIN = 0.05
# Answers per prompt a shape set is measured over.
DEFAULT_SAMPLES = 5
# A latency baseline below this is scheduling noise (a loaded CPU host moves a 5 ms
# answer by tens of ms); the shape set's baselines start here.
MIN_BASELINE_S = 0.05
# A range of answers that stopped early is widened by this share of its top, each way.
TOKEN_MARGIN = 0.25
# Covers a cold vLLM's first request (over 20 s seen) with room for a slower model or GPU.
DEFAULT_WARMUP_TIMEOUT_S = 120.0

# Short, varied prompts: facts, code, arithmetic, a list (different attention patterns).
DEFAULT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("capital", "The capital of France is"),
    ("code", "def fibonacci(n):\n    "),
    ("count", "1, 2, 3, 4, 5,"),
)


class _Timed:
    """One recorded answer and how long it took (to its first byte, and whole)."""

    __slots__ = ("answer", "total_s", "ttft_s")

    def __init__(self, answer: Answer, ttft_s: float, total_s: float) -> None:
        self.answer, self.ttft_s, self.total_s = answer, ttft_s, total_s


def _ask(target: ProbeTarget, canary_set: CanarySet, prompt: CanaryPrompt,
         transport: Transport, timeout_s: float, *, clock: Clock = SYSTEM_CLOCK,
         ) -> _Timed:
    path, body = build_request(canary_set, prompt)
    started = clock.now()
    try:
        reply = post_json(transport, target.url + path, body, timeout_s=timeout_s)
    except TransportError as exc:
        msg = f"worker {target.name!r}: {exc.message}"
        raise Unreachable(msg) from None
    total = clock.now() - started
    if canary_set.return_token_ids and reply.status in (400, 422) \
            and b"return_token_ids" in reply.body:
        raise TokenIdsRefused
    try:
        answer = parse_answer(reply)
    except BadResponse as exc:
        msg = f"worker {target.name!r}, prompt {prompt.name!r}: {exc}"
        raise CheckFailed(msg) from None
    first = reply.first_byte_s
    return _Timed(answer, total if first is None else min(first, total), total)


class _Session:
    """Asks one worker for a draft set's prompts: the warm-up first, then counted asks.

    A worker that refuses `return_token_ids` is asked again without it, and so is
    every later request (`draft` is the set as it is now being asked).
    """

    def __init__(self, target: ProbeTarget, draft: CanarySet, transport: Transport,
                 clock: Clock, on_progress: Callable[[int, int], None] | None) -> None:
        self.target, self.draft, self.transport, self.clock = target, draft, transport, clock
        self.on_progress = on_progress
        self.asked = 0
        self.total = 0

    def ask(self, prompt: CanaryPrompt, deadline_s: float) -> _Timed:
        try:
            return _ask(self.target, self.draft, prompt, self.transport, deadline_s,
                        clock=self.clock)
        except TokenIdsRefused:
            # Learnt once (the warm-up, or the first prompt): ask for text only from now on.
            self.draft = replace(self.draft, return_token_ids=False)
            return _ask(self.target, self.draft, prompt, self.transport, deadline_s,
                        clock=self.clock)

    def warm_up(self, warmup_timeout_s: float, on_warmup: Callable[[float], None] | None,
                ) -> None:
        if warmup_timeout_s <= 0 or not self.draft.prompts:
            return
        if on_warmup is not None:
            on_warmup(warmup_timeout_s)
        try:
            self.ask(self.draft.prompts[0], warmup_timeout_s)
        except Unreachable as exc:
            msg = f"{exc} (while waiting {warmup_timeout_s:g} s for its warm-up request)"
            raise Unreachable(msg) from None

    def ask_counted(self, prompt: CanaryPrompt, timeout_s: float) -> _Timed:
        timed = self.ask(prompt, timeout_s)
        self.asked += 1
        if self.on_progress is not None:
            self.on_progress(self.asked, self.total)
        return timed

    def recorded_from(self) -> str:
        target = self.target
        return target.url if target.name == target.url else f"{target.name} ({target.url})"


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


def record_canary_set(
    target: ProbeTarget, *, model: str, prompts: Sequence[tuple[str, str]] = DEFAULT_PROMPTS,
    max_tokens: int = 8, repeats: int = 3, timeout_s: float = 10.0,
    endpoint: str = "completions", transport: Transport | None = None,
    warmup_timeout_s: float = DEFAULT_WARMUP_TIMEOUT_S,
    on_warmup: Callable[[float], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> CanarySet:
    """Send every prompt `repeats` times and return the set of their agreed answers.

    First one warm-up request (the first prompt) may take up to `warmup_timeout_s`
    (0: no warm-up); `on_warmup(warmup_timeout_s)` is called before it is sent.
    `on_progress(done, total)` follows the recording requests (warm-up excluded).
    """
    draft = convert_struct({
        "model": model, "endpoint": endpoint,
        "prompts": [{"name": n, "prompt": p, "max_tokens": max_tokens, "expected_text": ""}
                    for n, p in prompts],
    }, CanarySet)
    session = _Session(target, draft, transport or Http1Transport(), SYSTEM_CLOCK, on_progress)
    session.warm_up(warmup_timeout_s, on_warmup)
    recorded = []
    session.total = len(draft.prompts) * repeats
    for prompt in draft.prompts:
        # Ask for logprobs while recording: the range is part of the golden answer.
        asking = replace(prompt, expected_top_logprob_range=(-1.0, 0.0))
        answers = [session.ask_counted(asking, timeout_s).answer for _ in range(repeats)]
        first = answers[0]
        for index, other in enumerate(answers[1:], start=2):
            if (other.token_ids, other.text) != (first.token_ids, first.text):
                msg = (f"worker {target.name!r} gave different answers to prompt "
                       f"{prompt.name!r} (run 1: {first.text!r}, run {index}: {other.text!r}); "
                       "refusing to record a golden answer that does not repeat (for a "
                       "worker whose greedy answers vary, record a shape set with --shape: "
                       f"{SHAPE_NOTE})")
                raise CheckFailed(msg)
        tops = [a.top_logprob for a in answers if a.top_logprob is not None]
        low_high = (
            (round(min(tops) - LOGPROB_MARGIN, 4), round(min(max(tops) + LOGPROB_MARGIN, 0.0), 4))
            if len(tops) == len(answers) and all(t > -1e6 for t in tops) else None
        )
        recorded.append(CanaryPrompt(
            name=prompt.name, prompt=prompt.prompt, max_tokens=max_tokens,
            expected_token_ids=first.token_ids, expected_text=first.text,
            expected_top_logprob_range=low_high, timeout_s=None,
        ))
    return CanarySet(
        model=model, endpoint=session.draft.endpoint,
        return_token_ids=session.draft.return_token_ids,
        recorded_from=session.recorded_from(), recorded_at=_now_iso(), prompts=tuple(recorded),
    )


def record_shape_set(
    target: ProbeTarget, *, model: str, prompts: Sequence[tuple[str, str]] = DEFAULT_PROMPTS,
    max_tokens: int = 8, samples: int = DEFAULT_SAMPLES, timeout_s: float = 10.0,
    endpoint: str = "completions", transport: Transport | None = None,
    latency_tolerance: float = DEFAULT_LATENCY_TOLERANCE,
    warmup_timeout_s: float = DEFAULT_WARMUP_TIMEOUT_S,
    on_warmup: Callable[[float], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None, clock: Clock = SYSTEM_CLOCK,
) -> CanarySet:
    """Stream every prompt `samples` times and return the shape set of their answers.

    The warm-up and `on_warmup`/`on_progress` are those of `record_canary_set`.
    `CheckFailed` when an answer is unusable, empty, or has no finish reason or
    token count (nothing to record a shape from); `Unreachable` when the worker
    does not answer.
    """
    placeholder: dict[str, Any] = {"finish_reasons": ["length"], "token_count": [1, max_tokens],
                                   "ttft_s": 1.0, "total_s": 1.0}
    draft = convert_struct({
        "kind": "shape", "model": model, "endpoint": endpoint,
        "latency_tolerance": latency_tolerance, "samples": samples,
        "prompts": [{"name": n, "prompt": p, "max_tokens": max_tokens, **placeholder}
                    for n, p in prompts],
    }, CanarySet)
    session = _Session(target, draft, transport or Http1Transport(), clock, on_progress)
    session.warm_up(warmup_timeout_s, on_warmup)
    session.total = len(draft.prompts) * samples
    recorded = []
    for prompt in draft.prompts:
        timed = [session.ask_counted(prompt, timeout_s) for _ in range(samples)]
        recorded.append(_shape_of(target, prompt, timed))
    return replace(session.draft, recorded_from=session.recorded_from(),
                   recorded_at=_now_iso(), prompts=tuple(recorded))


def _shape_of(target: ProbeTarget, prompt: CanaryPrompt, timed: Sequence[_Timed],
              ) -> CanaryPrompt:
    """The shape of a prompt's sampled answers; `CheckFailed` when one has none."""
    where = f"worker {target.name!r}, prompt {prompt.name!r}"
    reasons: list[str] = []
    counts: list[int] = []
    for index, sample in enumerate(timed, start=1):
        answer = sample.answer
        count = answer.token_count
        problem = ("an empty answer" if not answer.text
                   else "no finish reason" if answer.finish_reason is None
                   else "no token count (neither token ids nor usage)" if count is None
                   else None)
        if problem is not None or count is None or answer.finish_reason is None:
            msg = f"{where}: sample {index} has {problem}; refusing to record its shape"
            raise CheckFailed(msg)
        if answer.finish_reason not in reasons:
            reasons.append(answer.finish_reason)
        counts.append(count)
    low, high = min(counts), max(counts)
    if reasons != ["length"]:
        spread = math.ceil(TOKEN_MARGIN * high)
        low, high = max(1, low - spread), min(prompt.max_tokens, high + spread)
    high = max(high, low)

    def baseline(seconds: float) -> float:
        # Rounded up: a baseline never below what was measured, and ttft <= total stays.
        return math.ceil(max(seconds, MIN_BASELINE_S) * 10_000) / 10_000

    return replace(prompt, finish_reasons=tuple(reasons), token_count=(low, high),
                   ttft_s=baseline(max(t.ttft_s for t in timed)),
                   total_s=baseline(max(t.total_s for t in timed)), timeout_s=None)
