"""Continuation of a broken generation: the next upstream body, and when there is none.

The migration policy asks here for the body of its next upstream request, built
from the request's `StreamLedger` (`proxy/ledger.py`): the first request (always
streamed, with token ids), a retry, or the request that continues the generation
on another worker:

- completions: `prompt` = prompt ids + generated ids, the remaining
  `max_tokens`, the same sampling parameters and seed;
- chat: the same, token-exact: the chat stream's first chunk carries the
  rendered prompt's ids (`prompt_token_ids`), and the continuation goes to
  `/v1/completions` with prompt ids + generated ids as its prompt; its chunks
  reach the client in chat form (`delta.content`, chat logprobs). Re-sending the
  generated *text* would be approximate: a subword tokenizer re-tokenizes it
  into other ids (vLLM turned 100 generated ids into 136), and the model then
  continues from a context it never produced;
- servers without ids (and chats with tools or reasoning deltas, whose parsed
  form a completion cannot reproduce): the prompt text plus the generated text,
  for chat an assistant message with `continue_final_message: true` and
  `add_generation_prompt: false`, or, when the inventory names the model's
  tokenizer directory, the conversation rendered with the model's own chat template
  plus the generated text, on /v1/completions (servers that refuse
  `continue_final_message`). Approximate; the proxy says so in the
  `x-ftctl-continuation: text` header and the migration metric.

The body of a request the proxy cannot continue is refused up front
(`prepare_request`, `RequestRejected`), and a generation that must not go on
elsewhere is `NotContinuable`: the output already reaches `max_tokens` or the
model's maximum length (the client then gets `finish_reason: "length"`), or the
migration limit is spent.

Pure code: no I/O, no clock; the migration policy (`proxy/policy.py`) calls it.
"""

from __future__ import annotations

import copy
import os
import random
import secrets
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.proxy.errors import NotContinuable, RequestRejected
from dynamo_ftctl.proxy.ledger import LENGTH_KEYS

if TYPE_CHECKING:
    from dynamo_ftctl.proxy.ledger import Endpoint, StreamLedger

__all__ = [
    "NotContinuable",
    "RequestRejected",
    "continuation_request",
    "first_request",
    "prepare_request",
    "retry_request",
]

# Chat-only request fields: a chat continued through /v1/completions drops them (the
# rendered prompt's ids already hold what the template made of them).
_CHAT_ONLY_KEYS = (
    "messages", "continue_final_message", "add_generation_prompt", "chat_template",
    "chat_template_kwargs", "documents", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning_effort", "include_reasoning", "modalities", "audio", "mm_processor_kwargs",
    "max_completion_tokens", "logprobs", "top_logprobs", "add_special_tokens",
    "echo",
)
# What the proxy does with stop strings itself (never sent upstream).
_STOP_KEYS = ("stop", "include_stop_str_in_output")


# Stop strings a request may carry (OpenAI allows 4; vLLM does not bound them).
MAX_STOPS = 64
MAX_STOP_CHARS = 4096


def prepare_request(endpoint: Endpoint, body: Any) -> dict[str, Any]:
    """Validate a client body and return a copy ready for the ledger.

    Rejects what a single-stream continuation cannot serve (n > 1, best_of > 1)
    and adds a random `seed` to sampled requests that have none, so that a
    continuation samples from the same stream of random numbers.
    """
    if not isinstance(body, dict):
        msg = "request body must be a JSON object"
        raise RequestRejected(msg)
    if endpoint == "completions" and "prompt" not in body:
        msg = "missing 'prompt'"
        raise RequestRejected(msg)
    if endpoint == "chat" and not isinstance(body.get("messages"), list):
        msg = "missing 'messages' (a list)"
        raise RequestRejected(msg)
    if endpoint == "completions":
        prompt = body["prompt"]
        batched = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if batched and len(prompt) != 1:
            msg = "the migrating proxy serves one prompt per request"
            raise RequestRejected(msg)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        msg = "'stop' must be a string or a list of strings"
        raise RequestRejected(msg, "stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOPS or sum(map(len, stops)) > MAX_STOP_CHARS:
        # The proxy matches stop strings itself, each against the text held back per
        # token: bounded here, the cost per token is too.
        msg = (f"'stop' may hold at most {MAX_STOPS} strings of {MAX_STOP_CHARS} "
               "characters in all")
        raise RequestRejected(msg, "stop")
    stop_ids = body.get("stop_token_ids")
    if isinstance(stop_ids, list) and len(stop_ids) > MAX_STOPS * 16:
        msg = f"'stop_token_ids' may hold at most {MAX_STOPS * 16} ids"
        raise RequestRejected(msg, "stop_token_ids")
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and value != 1:
            # One ledger per request: a continuation carries one choice's tokens.
            msg = (f"the migrating proxy serves {key}=1 only (got {value!r}); "
                   "send one request per choice")
            raise RequestRejected(msg, key)
    out = dict(body)
    if endpoint == "completions" and isinstance(out["prompt"], list) and out["prompt"] \
            and isinstance(out["prompt"][0], list | str):
        out["prompt"] = out["prompt"][0]
    temperature = out.get("temperature")
    sampled = temperature is None or (isinstance(temperature, int | float) and temperature > 0)
    if sampled and out.get("seed") is None:
        out["seed"] = _SEEDS.getrandbits(31)
    return out


# Seeds of sampled requests: they need only differ, not be secret. A generator seeded
# once from the OS (not a urandom call a request, which shows in the proxy's profile
# on short requests), seeded again in a forked child, whose sequence must not repeat
# its parent's or its siblings'.
_SEEDS = random.Random(secrets.randbits(64))
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=lambda: _SEEDS.seed(secrets.randbits(64)))


def _upstream_body(ledger: StreamLedger) -> dict[str, Any]:
    """The client's body as every upstream request goes: streamed, usage and ids asked."""
    up = dict(ledger.body)
    if ledger.stops is not None and not ledger.whole:
        # A whole answer is never continued: its worker matches the stop strings.
        for key in _STOP_KEYS:
            up.pop(key, None)
    if ledger.whole:
        up["stream"] = False
        up.pop("stream_options", None)
    else:
        up["stream"] = True
        up["stream_options"] = {"include_usage": True}
    up["return_token_ids"] = True
    return up


def first_request(ledger: StreamLedger) -> dict[str, Any]:
    """The body of the first upstream request (always streamed, with token ids)."""
    ledger.upstream_endpoint = ledger.endpoint
    return _upstream_body(ledger)


def retry_request(ledger: StreamLedger) -> dict[str, Any]:
    """The body after a failure before any token: the first request again."""
    return first_request(ledger)


def continuation_request(ledger: StreamLedger) -> dict[str, Any]:
    """The body that continues the generation on another worker.

    Raises `NotContinuable` when the output is complete by length, the
    model's context is full, or the migration limit is spent.
    """
    remaining = None
    if ledger.max_tokens is not None:
        remaining = ledger.max_tokens - ledger.generated_count
        if remaining <= 0:
            msg = "the output already reached max_tokens"
            raise NotContinuable(msg, finish_reason="length")
    if ledger.max_model_len is not None and ledger.prompt_ids is not None \
            and len(ledger.prompt_ids) + ledger.generated_count >= ledger.max_model_len:
        msg = (f"prompt + output ({len(ledger.prompt_ids) + ledger.generated_count} tokens) "
               f"reached the model's maximum length {ledger.max_model_len}")
        raise NotContinuable(msg, finish_reason="length")
    if ledger.migrations >= ledger.migration_limit:
        msg = (f"migration limit reached ({ledger.migration_limit}); "
               f"the stream broke after {ledger.generated_count} tokens")
        raise NotContinuable(msg)
    if remaining is not None:
        remaining += rewind(ledger)
    up = _upstream_body(ledger)
    ledger.upstream_endpoint = ledger.endpoint
    if remaining is not None:
        for key in LENGTH_KEYS:
            if key in up:
                up[key] = remaining
    if ledger.generated_count == 0:
        return up
    if ledger.endpoint == "chat" and ledger.exact:
        return _chat_as_completion(ledger, up, remaining)
    if ledger.endpoint == "completions":
        if ledger.exact:
            assert ledger.prompt_ids is not None
            up["prompt"] = [*ledger.prompt_ids, *ledger.generated_ids]
        else:
            prompt = ledger.body["prompt"]
            if not isinstance(prompt, str):
                msg = "cannot continue a token-id prompt without the generated ids"
                raise NotContinuable(msg)
            up["prompt"] = prompt + ledger.generated_text
        return up
    if ledger.chat_template is not None:
        return _chat_through_template(ledger, up, remaining)
    messages = copy.deepcopy(ledger.body["messages"])
    if ledger.body.get("continue_final_message") and messages \
            and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        last = messages[-1]
        content = last.get("content") or ""
        if not isinstance(content, str):
            msg = "cannot continue an assistant message whose content is not text"
            raise NotContinuable(msg)
        last["content"] = content + ledger.generated_text
    else:
        messages.append({"role": "assistant", "content": ledger.generated_text})
    up["messages"] = messages
    up["continue_final_message"] = True
    up["add_generation_prompt"] = False
    return up


def rewind(ledger: StreamLedger) -> int:
    """Leave the unsettled ids out of the continuation's prompt; how many were left out.

    A worker holds back the text of a token that ends inside a character, and vLLM's
    detokenizer, given a token-id prompt that ends there, sent the prompt's whole text
    as the continuation's first delta (tokenizers' DecodeStream, primed with the prompt,
    lost its prefix: https://github.com/vllm-project/vllm/issues/17448). Starting the
    continuation before those ids makes it generate them again, text included. The
    client saw their ids (if it asked for ids) but not their text: a greedy run gives
    the same ids, which are not sent twice; a sampled one may not, so with ids visible
    it is not rewound.
    """
    held = min(ledger.unsettled, len(ledger.generated_ids))
    temperature = ledger.body.get("temperature")
    greedy = isinstance(temperature, int | float) and temperature == 0
    if not held or not ledger.exact or (ledger.client_wants_ids and not greedy):
        return 0
    ledger.replay = ledger.generated_ids[-held:] if ledger.client_wants_ids else []
    del ledger.generated_ids[-held:]
    ledger.generated_count -= held
    ledger.unsettled = 0
    return held


def _chat_through_template(ledger: StreamLedger, up: dict[str, Any],
                           remaining: int | None) -> dict[str, Any]:
    """A text chat continuation as a completion of the conversation rendered with the
    model's own template plus the text generated so far: for servers that refuse to
    continue an assistant message (`transformers serve`, TensorRT-LLM)."""
    from dynamo_ftctl.proxy.chat_template import TemplateFailed

    body = ledger.body
    kwargs = body.get("chat_template_kwargs")
    try:
        prompt = ledger.chat_template.continuation_prompt(
            body["messages"], ledger.generated_text, tools=body.get("tools"),
            extra=kwargs if isinstance(kwargs, dict) else None,
            continue_final=bool(body.get("continue_final_message")))
    except TemplateFailed as exc:
        raise NotContinuable(str(exc)) from None
    ledger.upstream_endpoint = "completions"
    for key in _CHAT_ONLY_KEYS:
        up.pop(key, None)
    if remaining is not None:
        up["max_tokens"] = remaining
    up["prompt"] = prompt
    logprobs = body.get("logprobs")
    if logprobs:
        top = body.get("top_logprobs")
        up["logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
    return up


def _chat_as_completion(ledger: StreamLedger, up: dict[str, Any],
                        remaining: int | None) -> dict[str, Any]:
    """A chat continuation as a completion of prompt ids + generated ids."""
    assert ledger.prompt_ids is not None
    ledger.upstream_endpoint = "completions"
    for key in _CHAT_ONLY_KEYS:
        up.pop(key, None)
    if remaining is not None:
        up["max_tokens"] = remaining
    up["prompt"] = [*ledger.prompt_ids, *ledger.generated_ids]
    logprobs = ledger.body.get("logprobs")
    if logprobs:  # chat: a bool and top_logprobs; completions: how many alternatives
        top = ledger.body.get("top_logprobs")
        up["logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
    return up

