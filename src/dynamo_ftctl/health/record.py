"""`ftctl canary record`: capture a golden canary set from a worker known to be good.

Each prompt is sent `repeats` times at temperature 0; the recording is refused
(`CheckFailed`, exit 1) when the answers disagree, because a golden answer that
is not reproducible would flag healthy workers. The top-logprob range is the
observed range widened by `LOGPROB_MARGIN` (float noise across batch shapes and
kernels moves logprobs a little without changing the argmax).

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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import CheckFailed, Unreachable
from dynamo_ftctl.health.canaryset import CanaryPrompt, CanarySet
from dynamo_ftctl.health.judge import Answer, BadResponse, build_request, parse_answer
from dynamo_ftctl.health.transport import Http1Transport, SyncTransport, TransportError
from dynamo_ftctl.structs import convert_struct, replace

if TYPE_CHECKING:
    from dynamo_ftctl.health.probe import ProbeTarget

__all__ = ["DEFAULT_PROMPTS", "DEFAULT_WARMUP_TIMEOUT_S", "LOGPROB_MARGIN", "record_canary_set"]

LOGPROB_MARGIN = 0.05
# Covers a cold vLLM's first request (over 20 s seen) with room for a slower model or GPU.
DEFAULT_WARMUP_TIMEOUT_S = 120.0

# Short, varied prompts: facts, code, arithmetic, a list (different attention patterns).
DEFAULT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("capital", "The capital of France is"),
    ("code", "def fibonacci(n):\n    "),
    ("count", "1, 2, 3, 4, 5,"),
)


class _TokenIdsRefused(Exception):
    """The worker refused the `return_token_ids` field (a strict OpenAI server)."""


def _ask(target: ProbeTarget, canary_set: CanarySet, prompt: CanaryPrompt,
         transport: SyncTransport, timeout_s: float) -> Answer:
    path, body = build_request(canary_set, prompt)
    try:
        reply = transport.post_json(target.url + path, body, timeout_s=timeout_s)
    except TransportError as exc:
        msg = f"worker {target.name!r}: {exc.message}"
        raise Unreachable(msg) from None
    if canary_set.return_token_ids and reply.status in (400, 422) \
            and b"return_token_ids" in reply.body:
        raise _TokenIdsRefused
    try:
        return parse_answer(reply)
    except BadResponse as exc:
        msg = f"worker {target.name!r}, prompt {prompt.name!r}: {exc}"
        raise CheckFailed(msg) from None


def record_canary_set(
    target: ProbeTarget, *, model: str, prompts: Sequence[tuple[str, str]] = DEFAULT_PROMPTS,
    max_tokens: int = 8, repeats: int = 3, timeout_s: float = 10.0,
    endpoint: str = "completions", transport: SyncTransport | None = None,
    warmup_timeout_s: float = DEFAULT_WARMUP_TIMEOUT_S,
    on_warmup: Callable[[float], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> CanarySet:
    """Send every prompt `repeats` times and return the set of their agreed answers.

    First one warm-up request (the first prompt) may take up to `warmup_timeout_s`
    (0: no warm-up); `on_warmup(warmup_timeout_s)` is called before it is sent.
    `on_progress(done, total)` follows the recording requests (warm-up excluded).
    """
    transport = transport or Http1Transport()
    draft = convert_struct({
        "model": model, "endpoint": endpoint,
        "prompts": [{"name": n, "prompt": p, "max_tokens": max_tokens, "expected_text": ""}
                    for n, p in prompts],
    }, CanarySet)

    def ask(prompt: CanaryPrompt, deadline_s: float) -> Answer:
        nonlocal draft
        try:
            return _ask(target, draft, prompt, transport, deadline_s)
        except _TokenIdsRefused:
            # Learnt once (the warm-up, or the first prompt): ask for text only from now on.
            draft = replace(draft, return_token_ids=False)
            return _ask(target, draft, prompt, transport, deadline_s)

    if warmup_timeout_s > 0 and draft.prompts:
        if on_warmup is not None:
            on_warmup(warmup_timeout_s)
        try:
            ask(draft.prompts[0], warmup_timeout_s)
        except Unreachable as exc:
            msg = f"{exc} (while waiting {warmup_timeout_s:g} s for its warm-up request)"
            raise Unreachable(msg) from None
    recorded = []
    total = len(draft.prompts) * repeats
    asked = 0

    def ask_counted(prompt: CanaryPrompt) -> Answer:
        nonlocal asked
        answer = ask(prompt, timeout_s)
        asked += 1
        if on_progress is not None:
            on_progress(asked, total)
        return answer

    for prompt in draft.prompts:
        # Ask for logprobs while recording: the range is part of the golden answer.
        asking = replace(prompt, expected_top_logprob_range=(-1.0, 0.0))
        answers = [ask_counted(asking) for _ in range(repeats)]
        first = answers[0]
        for index, other in enumerate(answers[1:], start=2):
            if (other.token_ids, other.text) != (first.token_ids, first.text):
                msg = (f"worker {target.name!r} gave different answers to prompt "
                       f"{prompt.name!r} (run 1: {first.text!r}, run {index}: {other.text!r}); "
                       "refusing to record a golden answer that does not repeat")
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
        model=model, endpoint=draft.endpoint, return_token_ids=draft.return_token_ids,
        recorded_from=target.url if target.name == target.url else f"{target.name} ({target.url})",
        recorded_at=dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        prompts=tuple(recorded),
    )
