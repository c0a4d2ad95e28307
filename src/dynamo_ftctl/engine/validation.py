"""The sim's OpenAI request validation: a generation request's body -> prompt ids and params.

Like vLLM (pydantic `extra="forbid"`), a field the sim does not know is a 400
naming it (`lenient_fields` turns this off), and so is text the tokenizer cannot
encode (a lone surrogate escape such as `"\\ud800"` in the prompt, a message's
content or a stop string): never a 500, which a proxy would take for a failing
worker. Every refusal here is a `ParamError` (an `InvalidInput` naming the field);
the routes turn it into the OpenAI error body.

This module reads bodies and knows the tokenizer and the engine config; it does
not answer HTTP and does not touch the engine's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.engine.errors import ParamError
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.openai import parse_request_json

if TYPE_CHECKING:
    from dynamo_ftctl.engine.config import EngineConfig
    from dynamo_ftctl.engine.scheduler import RequestParams
    from dynamo_ftctl.engine.tokenizer import SimTokenizer

__all__ = ["Generation", "Options", "check_model", "parse_body", "parse_generation"]


@dataclass(frozen=True)
class Options:
    """Per-request options that the HTTP layer (not the engine) handles."""

    stream: bool
    include_usage: bool
    return_token_ids: bool
    stop: tuple[str, ...]
    logprobs: int | None  # completions: top count; chat: top_logprobs (0 = chosen only)


@dataclass(frozen=True)
class Generation:
    """A validated generation request: what the engine computes and how to answer."""

    prompt_ids: list[int]
    params: RequestParams
    options: Options


# The request fields vLLM accepts that the sim implements, or can ignore without changing
# what it computes (who asks, scheduling hints, how specials are rendered).
_FIELDS_BOTH = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "stream", "stream_options", "n", "ignore_eos", "min_tokens", "return_token_ids", "logprobs",
    "user", "priority", "skip_special_tokens", "spaces_between_special_tokens",
    *("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"),
})
_FIELDS = {
    False: _FIELDS_BOTH | {"prompt", "echo"},
    True: _FIELDS_BOTH | {"messages", "max_completion_tokens", "top_logprobs",
                          "continue_final_message", "add_generation_prompt"},
}
# Sampling knobs the sim does not implement: accepted only at the value that changes nothing.
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0}


def parse_body(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object (bounded depth, no NaN), or a `ParamError`."""
    try:
        doc = parse_request_json(body)
    except ValueError as exc:
        msg = f"request body is not valid JSON: {exc}"
        raise ParamError(msg) from None
    if not isinstance(doc, dict):
        msg = "request body must be a JSON object"
        raise ParamError(msg)
    return doc


def check_model(body: Mapping[str, Any], served: str) -> str | None:
    """The model the body names when it is not the `served` one (a 404), else None."""
    model = body.get("model")
    return str(model) if model is not None and model != served else None


def _get(body: Mapping[str, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        msg = f"'{key}' must be {kinds[0].__name__}, got {value!r}"
        raise ParamError(msg, key)
    return value


def check_fields(body: Mapping[str, Any], *, chat: bool) -> None:
    """400 for an unknown field or a sampling knob the sim cannot honour (as vLLM's pydantic
    models with `extra="forbid"` reject the first)."""
    unknown = sorted(set(body) - _FIELDS[chat])
    if unknown:
        msg = f"Extra inputs are not permitted: {unknown[0]!r}"
        if len(unknown) > 1:
            msg += f" (also: {', '.join(map(repr, unknown[1:]))})"
        raise ParamError(msg, unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            msg = f"'{name}' is not implemented by ftctl sim (only {neutral} is accepted)"
            raise ParamError(msg, name)


# Bounds of what the engine can run (vLLM refuses the same values with a 400): ids and
# top_k within the vocabulary, a 64-bit seed, counts that fit a C long. Below this
# temperature, sampling divides logits into infinities: vLLM treats it as greedy too.
_MAX_COUNT = 2**31 - 1
_MIN_TEMPERATURE = 1e-5
_MAX_TEMPERATURE = 1e4
_MAX_STOP_IDS = 1024


def _bounded(body: Mapping[str, Any], key: str, lo: int, hi: int, default: Any) -> Any:
    """An integer field within [lo, hi], or its default when absent; a `ParamError` else."""
    value = _get(body, key, (int,), default)
    if value is not default and not lo <= value <= hi:
        msg = f"'{key}' must be between {lo} and {hi}, got {value}"
        raise ParamError(msg, key)
    return value


def _sampling(body: Mapping[str, Any], prompt_len: int, max_len: int,
              default_max: int | None, num_top: int, *, vocab: int) -> RequestParams:
    from dynamo_ftctl.engine.scheduler import RequestParams

    if _get(body, "n", (int,), 1) != 1:
        msg = "only n=1 is supported"
        raise ParamError(msg, "n")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _bounded(body, key, 1, _MAX_COUNT, None)
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else max(max_len - prompt_len, 1)
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 <= temperature <= _MAX_TEMPERATURE:
        msg = f"'temperature' must be between 0 and {_MAX_TEMPERATURE:g}, got {temperature}"
        raise ParamError(msg, "temperature")
    if not 0 < top_p <= 1:
        msg = f"'top_p' must be in (0, 1], got {top_p}"
        raise ParamError(msg, "top_p")
    top_k = _bounded(body, "top_k", -1, vocab, 0)
    seed = _bounded(body, "seed", -(2**63), 2**64 - 1, None)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > _MAX_STOP_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
        msg = (f"'stop_token_ids' must be at most {_MAX_STOP_IDS} token ids in "
               f"[0, {vocab})")
        raise ParamError(msg, "stop_token_ids")
    min_tokens = _bounded(body, "min_tokens", 0, max_tokens, 0)
    return RequestParams(
        max_tokens=max_tokens,
        temperature=temperature if temperature >= _MIN_TEMPERATURE else 0.0,
        top_p=top_p, top_k=max(top_k, 0), seed=seed,
        ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)), num_top=num_top,
        stop_token_ids=tuple(stop_ids), min_tokens=min_tokens,
    )


def _options(body: Mapping[str, Any], logprobs: int | None, tok: SimTokenizer) -> Options:
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        msg = "'stop' must be a string or a list of strings"
        raise ParamError(msg, "stop")
    for stop_string in stops:  # one the model could never write
        _check_encodable(tok, stop_string, "stop")
    stream_options = body.get("stream_options") or {}
    return Options(
        stream=bool(_get(body, "stream", (bool,), False)),
        include_usage=bool(isinstance(stream_options, dict)
                           and stream_options.get("include_usage")),
        return_token_ids=bool(_get(body, "return_token_ids", (bool,), False)),
        stop=stops, logprobs=logprobs,
    )


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, dict) and p.get("type") == "text")
    msg = "message 'content' must be a string or a list of text parts"
    raise ParamError(msg, "messages")


def _check_encodable(tok: SimTokenizer, text: str, param: str) -> None:
    """A 400 naming `param` for text the tokenizer cannot encode (never a 500)."""
    try:
        tok.check_encodable(text)
    except InvalidInput as exc:
        raise ParamError(f"'{param}': {exc}", param) from None


def _prompt_ids(tok: SimTokenizer, prompt: Any, vocab: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_encodable(tok, prompt, "prompt")
        return tok.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            msg = f"'prompt': token id {bad} is out of range [0, {vocab})"
            raise ParamError(msg, "prompt")
        return list(prompt)
    msg = "'prompt' must be a string or a non-empty list of token ids (one prompt)"
    raise ParamError(msg, "prompt")


def _chat_prompt(tok: SimTokenizer, body: Mapping[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) for m in messages):
        msg = "'messages' must be a non-empty list of objects"
        raise ParamError(msg, "messages")
    cont = bool(_get(body, "continue_final_message", (bool,), False))
    add = bool(_get(body, "add_generation_prompt", (bool,), not cont))
    if cont and add:
        msg = "continue_final_message and add_generation_prompt cannot both be true"
        raise ParamError(msg, "continue_final_message")
    contents = [_content(m) for m in messages]
    for index, text in enumerate(contents):
        _check_encodable(tok, text, f"messages[{index}].content")
    return tok.apply_chat_template(
        [{"role": str(m.get("role", "user")), "content": text}
         for m, text in zip(messages, contents, strict=True)],
        add_generation_prompt=add, continue_final_message=cont,
    )


def parse_generation(body: Mapping[str, Any], config: EngineConfig, tok: SimTokenizer, *,
                     chat: bool) -> Generation:
    """A completion (or chat) body, checked field by field (`ParamError` on the first fault;
    `InvalidInput` from the tokenizer)."""
    vocab = config.vocab_size or tok.vocab_size
    if chat:
        prompt_ids = _chat_prompt(tok, body)
        logprobs = (_bounded(body, "top_logprobs", 0, 20, 0)
                    if _get(body, "logprobs", (bool,), False) else None)
        default_max = None
    else:
        prompt_ids = _prompt_ids(tok, body.get("prompt"), vocab)
        if _get(body, "echo", (bool,), False):
            msg = "echo is not supported"
            raise ParamError(msg, "echo")
        logprobs = _get(body, "logprobs", (int,), None)
        default_max = 16  # OpenAI's default for /v1/completions
    if logprobs is not None and not 0 <= logprobs <= 20:
        msg = "logprobs must be between 0 and 20"
        raise ParamError(msg, "logprobs")
    params = _sampling(body, len(prompt_ids), config.max_model_len, default_max, logprobs or 0,
                       vocab=vocab)
    return Generation(prompt_ids, params, _options(body, logprobs, tok))
