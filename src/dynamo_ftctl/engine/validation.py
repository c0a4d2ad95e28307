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

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.openai import parse_request_json

if TYPE_CHECKING:
    from dynamo_ftctl.engine.config import EngineConfig
    from dynamo_ftctl.engine.scheduler import RequestParams
    from dynamo_ftctl.engine.tokenizer import SimTokenizer

__all__ = ["Generation", "Options", "ParamError", "check_model", "parse_body",
           "parse_generation"]


class ParamError(InvalidInput):
    """A request field the sim refuses (400 naming `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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


def _sampling(body: Mapping[str, Any], prompt_len: int, max_len: int,
              default_max: int | None, num_top: int) -> RequestParams:
    from dynamo_ftctl.engine.scheduler import RequestParams

    if _get(body, "n", (int,), 1) != 1:
        msg = "only n=1 is supported"
        raise ParamError(msg, "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else max(max_len - prompt_len, 1)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        msg = f"'max_tokens' must be a positive integer, got {max_tokens!r}"
        raise ParamError(msg, "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = int(_get(body, "top_k", (int,), 0))
    if temperature < 0 or not 0 < top_p <= 1:
        msg = "temperature must be >= 0 and top_p in (0, 1]"
        raise ParamError(msg, "temperature")
    seed = _get(body, "seed", (int,), None)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    min_tokens = _get(body, "min_tokens", (int,), 0)
    if min_tokens < 0:
        msg = f"'min_tokens' must be >= 0, got {min_tokens}"
        raise ParamError(msg, "min_tokens")
    return RequestParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
        seed=seed, ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)), num_top=num_top,
        stop_token_ids=tuple(int(t) for t in stop_ids), min_tokens=min_tokens,
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


def _prompt_ids(tok: SimTokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_encodable(tok, prompt, "prompt")
        return tok.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
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
    if chat:
        prompt_ids = _chat_prompt(tok, body)
        logprobs = (int(_get(body, "top_logprobs", (int,), 0))
                    if _get(body, "logprobs", (bool,), False) else None)
        default_max = None
    else:
        prompt_ids = _prompt_ids(tok, body.get("prompt"))
        if _get(body, "echo", (bool,), False):
            msg = "echo is not supported"
            raise ParamError(msg, "echo")
        logprobs = _get(body, "logprobs", (int,), None)
        default_max = 16  # OpenAI's default for /v1/completions
    if logprobs is not None and not 0 <= logprobs <= 20:
        msg = "logprobs must be between 0 and 20"
        raise ParamError(msg, "logprobs")
    params = _sampling(body, len(prompt_ids), config.max_model_len, default_max, logprobs or 0)
    return Generation(prompt_ids, params, _options(body, logprobs, tok))
