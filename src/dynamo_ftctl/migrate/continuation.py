"""Continuation of a broken generation: the ledger of one client request.

A `StreamLedger` sees every chunk a worker streams for one client request and
keeps what a continuation needs: the prompt token ids and every generated
token id (or, from servers that return no ids, the generated text). It turns
upstream chunks into the chunks the client sees (one `id`, one `model`, one
`created`, no second `role` delta, no per-worker usage), and builds the
request that continues the generation on another worker:

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
  `add_generation_prompt: false`. Approximate; the proxy says so in the
  `x-ftctl-continuation: text` header and the migration metric.

Stop strings are matched here, not by the workers: a stop string may straddle
the failure point, and no worker sees both sides of it. The upstream request
goes without `stop`; `StopFinder` runs over the whole output across workers,
holding back the text that may begin a stop string (as vLLM and `ftctl sim`
do), and the proxy cuts the upstream stream when it matches.

The ledger decides when a request must not be continued (`NotContinuable`):
the output already reaches `max_tokens` or the model's maximum length (the
client then gets `finish_reason: "length"`), or the migration limit is spent.

Pure code: no I/O, no clock; the proxy (`migrate/proxy.py`) drives it.
"""

from __future__ import annotations

import copy
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from dynamo_ftctl.openai import StopFinder

__all__ = [
    "Endpoint",
    "ErrorEvent",
    "MalformedChunk",
    "NotContinuable",
    "RequestRejected",
    "StopFinder",
    "StreamLedger",
    "Usage",
    "new_request_id",
    "prepare_request",
]

Endpoint = Literal["completions", "chat"]

# Sampling parameters that must be carried unchanged into a continuation;
# everything else in the client's body is carried too, these are just the ones
# the ledger must never drop or rewrite.
_LENGTH_KEYS = ("max_tokens", "max_completion_tokens")
# Request ids: a random tag per process and a counter (uuid4 costs a urandom call
# per request, 1.4% of the proxy's CPU on short requests), laid out as a version-4
# UUID: servers that validate `X-Request-Id` as a UUID refuse anything else (400).
_ID_TAG = secrets.token_hex(8)
_ID_COUNTER = itertools.count()
# Chat-only request fields: a chat continued through /v1/completions drops them (the
# rendered prompt's ids already hold what the template made of them).
_CHAT_ONLY_KEYS = (
    "messages", "continue_final_message", "add_generation_prompt", "chat_template",
    "chat_template_kwargs", "documents", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning_effort", "include_reasoning", "modalities", "audio", "mm_processor_kwargs",
    "max_completion_tokens", "logprobs", "top_logprobs", "add_special_tokens",
    "echo",
)
# Delta fields a completion cannot reproduce (parsed tool calls, reasoning text): a chat
# that has streamed them is continued as a chat (text), not through /v1/completions.
_PARSED_DELTA_KEYS = ("tool_calls", "reasoning_content", "reasoning", "function_call")


def new_request_id() -> str:
    """A fresh request id in the form of a version-4 UUID (random per process, counted)."""
    n = next(_ID_COUNTER) & ((1 << 60) - 1)
    tag = _ID_TAG
    # 8-4-4-4-12 hex; "4" marks version 4 and "8"-"b" the RFC 4122 variant.
    return (f"{tag[:8]}-{tag[8:12]}-4{tag[12:15]}-{8 | (n >> 58) & 3:x}{(n >> 48) & 0x3ff:03x}"
            f"-{n & 0xffffffffffff:012x}")
# What the proxy does with stop strings itself (never sent upstream).
_STOP_KEYS = ("stop", "include_stop_str_in_output")


class MalformedChunk(ValueError):
    """An upstream chunk that is not a valid completion chunk (garbage from a worker)."""


class ErrorEvent(MalformedChunk):
    """An SSE error event (`{"error": {...}}`); `status` is its HTTP-like code, if it has one.

    vLLM streams a request's own validation errors this way once the headers are
    out (`"code": 400`, type `BadRequestError`): those are the client's, not the
    worker's (`proxy` passes them on); other codes are failures of the worker.
    """

    def __init__(self, message: str, doc: dict[str, Any]) -> None:
        super().__init__(message)
        self.doc = doc
        self.status = _error_status(doc.get("error"))


def _error_status(error: Any) -> int | None:
    """The code of an OpenAI error object as an HTTP status (400 for a named bad request)."""
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        return code
    if error.get("type") in ("invalid_request_error", "BadRequestError"):
        return 400
    return None


class NotContinuable(Exception):
    """The generation cannot go on elsewhere; `finish_reason` says how to end it cleanly.

    `finish_reason` is "length" when the output reached max_tokens or the
    model's maximum length (a clean end), None when the request must end with
    an error (migration limit spent, n>1, ...).
    """

    def __init__(self, message: str, finish_reason: str | None = None) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


class RequestRejected(ValueError):
    """The client's body cannot be served by the migrating proxy (HTTP 400).

    `param` names the offending field, as OpenAI's error body does.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Usage:
    """Token counts of the whole client request, every token counted once."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


def prepare_request(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
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
        out["seed"] = secrets.randbelow(2**31)
    return out


def _choice_of(doc: dict[str, Any]) -> dict[str, Any] | None:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        raise MalformedChunk("chunk has no 'choices' list")
    if not choices:
        return None
    first = choices[0]
    if not isinstance(first, dict):
        raise MalformedChunk("choice is not an object")
    if len(choices) > 1 or first.get("index", 0) != 0:
        raise MalformedChunk("more than one choice in a stream of n=1")
    return first


_INT = {int}


def _int_list(value: Any, what: str) -> list[int]:
    # Fast path for what a JSON decoder gives: a list of exact ints, checked in C
    # (a 120-token prompt's ids: 3 us instead of 12 us for the generator below).
    if type(value) is list and (not value or set(map(type, value)) == _INT):
        return value
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MalformedChunk(f"{what} is not a list of integers")
    return value


@dataclass
class StreamLedger:
    """Everything one client request has received so far, across workers."""

    endpoint: Endpoint
    body: dict[str, Any]
    migration_limit: int = 3
    max_model_len: int | None = None
    # The client's `X-Request-Id`, passed to every worker and echoed back; a fresh UUID
    # when the client sent none. The answer's `id` is the endpoint's prefix and this.
    trace_id: str = ""
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_ids: list[int] | None = None
    generated_ids: list[int] = field(default_factory=list)
    generated_text: str = ""
    generated_count: int = 0
    ids_mode: bool = True
    finish_reason: str | None = None
    migrations: int = 0
    attempt_tokens: int = 0
    prompt_tokens_reported: int | None = None
    logprobs: dict[str, Any] | None = None
    workers: list[str] = field(default_factory=list)
    # The serving worker's time to first token as the proxy saw it (request written to
    # the first byte of the answer's body): the client's TTFT less this is the proxy's.
    upstream_ttft_s: float | None = None
    # The endpoint of the current upstream attempt: a chat continued from token ids
    # streams from "completions" (see `continuation_request`).
    upstream_endpoint: Endpoint = "completions"
    # A chat delta carried a parsed field (tool calls, reasoning) a completion cannot give.
    parsed_deltas: bool = False
    # Trailing generated ids whose text the worker has held back so far (the first bytes
    # of a character): a continuation starts before them (see `_rewind`).
    _unsettled: int = 0
    # Ids a rewound continuation generates again that the client already has.
    _replay: list[int] = field(default_factory=list)
    _role_sent: bool = False
    _prompt_ids_sent: bool = False
    _fingerprint: str | None = None
    # Stop strings the proxy matches itself (None: the request has none).
    stops: StopFinder | None = None
    stopped: bool = False  # a stop string matched: the upstream stream must be cut
    _client_text: str = ""  # the text sent to the client (kept only with stop strings)

    def __post_init__(self) -> None:
        self.stops = StopFinder.from_body(self.body)
        self.upstream_endpoint = self.endpoint
        if not self.trace_id:
            self.trace_id = new_request_id()
        if not self.request_id:
            prefix = "chatcmpl" if self.endpoint == "chat" else "cmpl"
            self.request_id = f"{prefix}-{self.trace_id}"
        prompt = self.body.get("prompt")
        if self.endpoint == "completions" and isinstance(prompt, list) and all(
            isinstance(v, int) for v in prompt
        ):
            self.prompt_ids = list(prompt)

    # ------------------------------------------------------------------ requests

    @property
    def client_wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def client_streams(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def client_wants_usage(self) -> bool:
        options = self.body.get("stream_options")
        return not self.client_streams or (
            isinstance(options, dict) and bool(options.get("include_usage"))
        )

    @property
    def max_tokens(self) -> int | None:
        for key in _LENGTH_KEYS:
            value = self.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @property
    def output_text(self) -> str:
        """The text the client has been given (the generated text less stop handling)."""
        return self.generated_text if self.stops is None else self._client_text

    def _base_upstream(self) -> dict[str, Any]:
        up = dict(self.body)
        if self.stops is not None:
            for key in _STOP_KEYS:
                up.pop(key, None)
        up["stream"] = True
        up["stream_options"] = {"include_usage": True}
        up["return_token_ids"] = True
        return up

    @property
    def upstream_path(self) -> str:
        """The path of the current upstream attempt's endpoint."""
        return "/v1/chat/completions" if self.upstream_endpoint == "chat" else "/v1/completions"

    def first_request(self) -> dict[str, Any]:
        """The body of the first upstream request (always streamed, with token ids)."""
        self.upstream_endpoint = self.endpoint
        return self._base_upstream()

    def retry_request(self) -> dict[str, Any]:
        """The body after a failure before any token: the first request again."""
        return self.first_request()

    @property
    def exact(self) -> bool:
        """Whether a continuation is token-exact: prompt ids + generated ids.

        Otherwise it re-sends text (the worker returned no ids, or a chat streamed
        parsed tool calls or reasoning that a completion cannot reproduce).
        """
        if not self.ids_mode or self.prompt_ids is None:
            return False
        if self.endpoint == "completions":
            return True
        tools = self.body.get("tools")
        return not self.parsed_deltas and not (tools and self.body.get("tool_choice") != "none")

    def continuation_request(self) -> dict[str, Any]:
        """The body that continues the generation on another worker.

        Raises `NotContinuable` when the output is complete by length, the
        model's context is full, or the migration limit is spent.
        """
        remaining = None
        if self.max_tokens is not None:
            remaining = self.max_tokens - self.generated_count
            if remaining <= 0:
                msg = "the output already reached max_tokens"
                raise NotContinuable(msg, finish_reason="length")
        if self.max_model_len is not None and self.prompt_ids is not None \
                and len(self.prompt_ids) + self.generated_count >= self.max_model_len:
            msg = (f"prompt + output ({len(self.prompt_ids) + self.generated_count} tokens) "
                   f"reached the model's maximum length {self.max_model_len}")
            raise NotContinuable(msg, finish_reason="length")
        if self.migrations >= self.migration_limit:
            msg = (f"migration limit reached ({self.migration_limit}); "
                   f"the stream broke after {self.generated_count} tokens")
            raise NotContinuable(msg)
        if remaining is not None:
            remaining += self._rewind()
        up = self._base_upstream()
        self.upstream_endpoint = self.endpoint
        if remaining is not None:
            for key in _LENGTH_KEYS:
                if key in up:
                    up[key] = remaining
        if self.generated_count == 0:
            return up
        if self.endpoint == "chat" and self.exact:
            return self._chat_as_completion(up, remaining)
        if self.endpoint == "completions":
            if self.exact:
                assert self.prompt_ids is not None
                up["prompt"] = [*self.prompt_ids, *self.generated_ids]
            else:
                prompt = self.body["prompt"]
                if not isinstance(prompt, str):
                    msg = "cannot continue a token-id prompt without the generated ids"
                    raise NotContinuable(msg)
                up["prompt"] = prompt + self.generated_text
            return up
        messages = copy.deepcopy(self.body["messages"])
        if self.body.get("continue_final_message") and messages \
                and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            last = messages[-1]
            content = last.get("content") or ""
            if not isinstance(content, str):
                msg = "cannot continue an assistant message whose content is not text"
                raise NotContinuable(msg)
            last["content"] = content + self.generated_text
        else:
            messages.append({"role": "assistant", "content": self.generated_text})
        up["messages"] = messages
        up["continue_final_message"] = True
        up["add_generation_prompt"] = False
        return up

    def _rewind(self) -> int:
        """Leave the unsettled ids out of the continuation's prompt; how many were left out.

        A worker holds back the text of a token that ends inside a character, and vLLM's
        detokenizer, given a token-id prompt that ends there, sent the prompt's whole
        text as the continuation's first delta (tokenizers' DecodeStream, primed with
        the prompt, lost its prefix; vLLM issue 17448). Starting the continuation before
        those ids makes it generate them again, text included. The client saw their ids
        (if it asked for ids) but not their text: a greedy run gives the same ids, which
        are not sent twice; a sampled one may not, so with ids visible it is not rewound.
        """
        held = min(self._unsettled, len(self.generated_ids))
        temperature = self.body.get("temperature")
        greedy = isinstance(temperature, int | float) and temperature == 0
        if not held or not self.exact or (self.client_wants_ids and not greedy):
            return 0
        self._replay = self.generated_ids[-held:] if self.client_wants_ids else []
        del self.generated_ids[-held:]
        self.generated_count -= held
        self._unsettled = 0
        return held

    def _chat_as_completion(self, up: dict[str, Any], remaining: int | None) -> dict[str, Any]:
        """A chat continuation as a completion of prompt ids + generated ids."""
        assert self.prompt_ids is not None
        self.upstream_endpoint = "completions"
        for key in _CHAT_ONLY_KEYS:
            up.pop(key, None)
        if remaining is not None:
            up["max_tokens"] = remaining
        up["prompt"] = [*self.prompt_ids, *self.generated_ids]
        logprobs = self.body.get("logprobs")
        if logprobs:  # chat: a bool and top_logprobs; completions: how many alternatives
            top = self.body.get("top_logprobs")
            up["logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
        return up

    # ------------------------------------------------------------------ chunks

    def start_attempt(self, worker: str = "") -> None:
        """A new upstream stream begins on `worker` (first try, retry or continuation)."""
        self.attempt_tokens = 0
        if worker:
            self.workers.append(worker)

    def note_migration(self) -> None:
        """Count one continuation on another worker."""
        self.migrations += 1

    def observe(self, doc: Any) -> dict[str, Any] | None:
        """Record one upstream chunk; return the chunk to send to the client, or None.

        Raises `MalformedChunk` for anything that is not a completion chunk,
        including an SSE error event (`{"error": ...}`) and output past
        `max_tokens` (an endless stream).
        """
        if not isinstance(doc, dict):
            raise MalformedChunk("chunk is not a JSON object")
        if "error" in doc:
            error = doc["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise ErrorEvent(f"error event from worker: {message}", doc)
        choice = _choice_of(doc)
        prompt_ids = doc.get("prompt_token_ids")
        if choice is not None and prompt_ids is None:
            prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is not None and self.prompt_ids is None and self.migrations == 0:
            self.prompt_ids = list(_int_list(prompt_ids, "prompt_token_ids"))
        usage = doc.get("usage")
        if isinstance(usage, dict) and self.prompt_tokens_reported is None \
                and self.migrations == 0 and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens_reported = usage["prompt_tokens"]
        if choice is None:
            return None  # the worker's usage chunk: the proxy sends its own at the end
        return self._observe_choice(doc, choice)

    def _observe_choice(self, doc: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any] | None:
        if self.upstream_endpoint == "chat":
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                raise MalformedChunk("chat chunk without a 'delta' object")
            text = delta.get("content")
            if not self.parsed_deltas and any(delta.get(k) for k in _PARSED_DELTA_KEYS):
                self.parsed_deltas = True
        else:
            text = choice.get("text")
            if self.endpoint == "chat":
                choice = _chat_choice(choice, text)
        if text is not None and not isinstance(text, str):
            raise MalformedChunk("chunk text is not a string")
        ids = choice.get("token_ids")
        new_ids = _int_list(ids, "token_ids") if ids is not None else None
        if new_ids is None and text:
            self.ids_mode = False
        count = len(new_ids) if new_ids is not None else (1 if text else 0)
        limit = self.max_tokens
        if limit is not None and self.generated_count + count > limit:
            raise MalformedChunk(f"worker sent more than max_tokens={limit} tokens")
        if new_ids is not None:
            self.generated_ids.extend(new_ids)
            self._unsettled = 0 if text else self._unsettled + len(new_ids)
            if self._replay:  # the client has these ids already (see `_rewind`)
                again = min(len(self._replay), len(new_ids))
                del self._replay[:again]
                new_ids = new_ids[again:]
        self.generated_count += count
        self.attempt_tokens += count
        if text:
            self.generated_text += text
        self._merge_logprobs(choice.get("logprobs"))
        finish = choice.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise MalformedChunk("finish_reason is not a string")
        if self.stops is not None:
            text, hit = self.stops.feed(text or "", final=finish is not None)
            if hit:
                finish = "stop"
                self.stopped = True
            self._client_text += text
            choice = self._with_text(choice, text, finish)
        if finish is not None:
            self.finish_reason = finish
        return self._client_chunk(doc, choice, text, new_ids)

    def _with_text(self, choice: dict[str, Any], text: str,
                   finish: str | None) -> dict[str, Any]:
        """`choice` carrying `text` (after stop handling) and `finish`."""
        out = dict(choice)
        out["finish_reason"] = finish
        if self.endpoint == "chat":
            delta = dict(choice["delta"])
            if text or "content" in delta:
                delta["content"] = text
            out["delta"] = delta
        else:
            out["text"] = text
        return out

    def _client_chunk(self, doc: dict[str, Any], choice: dict[str, Any], text: str | None,
                      new_ids: list[int] | None) -> dict[str, Any] | None:
        out_choice = dict(choice)
        out_choice["index"] = 0
        out_choice.pop("prompt_token_ids", None)
        if not self.client_wants_ids:
            out_choice.pop("token_ids", None)
        elif new_ids is not None:
            out_choice["token_ids"] = new_ids
        if self.endpoint == "chat":
            delta = dict(choice["delta"])
            if "role" in delta:
                if self._role_sent:
                    del delta["role"]
                else:
                    self._role_sent = True
            out_choice["delta"] = delta
            empty = not delta and not text
        else:
            empty = not text
        if empty and choice.get("finish_reason") is None and not new_ids \
                and choice.get("logprobs") is None:
            return None  # e.g. the second worker's role-only first chunk
        out: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.endpoint == "chat" else "text_completion",
            "created": self.created,
            "model": self.body.get("model", doc.get("model")),
            "choices": [out_choice],
        }
        if self._fingerprint is None and isinstance(doc.get("system_fingerprint"), str):
            self._fingerprint = doc["system_fingerprint"]
        if self._fingerprint is not None:
            out["system_fingerprint"] = self._fingerprint
        if self.client_wants_ids and self.prompt_ids is not None and not self._prompt_ids_sent:
            out["prompt_token_ids"] = self.prompt_ids
            self._prompt_ids_sent = True
        return out

    def _merge_logprobs(self, logprobs: Any) -> None:
        """Accumulate logprobs for a non-streamed answer (completions or chat layout)."""
        if self.client_streams or not isinstance(logprobs, dict):
            return
        if self.logprobs is None:
            self.logprobs = {}
        for key, value in logprobs.items():
            if isinstance(value, list):
                self.logprobs.setdefault(key, []).extend(value)

    # ------------------------------------------------------------------ endings

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def usage(self) -> Usage:
        """Usage of the whole request, each token counted once."""
        if self.prompt_ids is not None:
            prompt = len(self.prompt_ids)
        else:
            prompt = self.prompt_tokens_reported or 0
        return Usage(prompt_tokens=prompt, completion_tokens=self.generated_count)

    def usage_chunk(self) -> dict[str, Any]:
        """The final `choices: []` chunk carrying the request's usage."""
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.endpoint == "chat" else "text_completion",
            "created": self.created,
            "model": self.body.get("model"),
            "choices": [],
            "usage": self.usage().to_json(),
        }

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        """A chunk that ends the stream cleanly (e.g. "length" at the model's max length)."""
        self.finish_reason = finish_reason
        held = self.stops.flush() if self.stops is not None else ""
        self._client_text += held
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.endpoint == "chat":
            choice["delta"] = {"content": held} if held else {}
        else:
            choice["text"] = held
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.endpoint == "chat" else "text_completion",
            "created": self.created,
            "model": self.body.get("model"),
            "choices": [choice],
        }

    def response(self) -> dict[str, Any]:
        """The whole non-streamed answer, assembled from every worker's chunks."""
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
        }
        if self.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": self.output_text}
            obj = "chat.completion"
        else:
            choice["text"] = self.output_text
            obj = "text_completion"
        if self.client_wants_ids:
            choice["token_ids"] = self.generated_ids
        out: dict[str, Any] = {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.body.get("model"),
            "choices": [choice],
            "usage": self.usage().to_json(),
        }
        if self.client_wants_ids and self.prompt_ids is not None:
            out["prompt_token_ids"] = self.prompt_ids
        return out


def _chat_choice(choice: dict[str, Any], text: Any) -> dict[str, Any]:
    """A completion chunk's choice in the form of a chat chunk's (a chat continued by ids)."""
    out = {k: v for k, v in choice.items() if k not in ("text", "logprobs")}
    out["delta"] = {"content": text} if text else {}
    out["logprobs"] = chat_logprobs(choice.get("logprobs"))
    return out


def chat_logprobs(logprobs: Any) -> dict[str, Any] | None:
    """Completions logprobs (`tokens`, `token_logprobs`, `top_logprobs`) in chat's layout.

    Chat's `content` entries carry each token's text, its logprob, its UTF-8 bytes and
    the alternatives as entries of their own (OpenAI's chat logprobs object).
    """
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens")
    values = logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    tops = logprobs.get("top_logprobs")
    if not isinstance(tops, list):
        tops = [None] * len(tokens)

    def entry(token: Any, value: Any) -> dict[str, Any]:
        text = str(token)
        return {"token": text, "logprob": value,
                "bytes": list(text.encode("utf-8", "surrogatepass"))}

    content = []
    for token, value, top in zip(tokens, values, tops, strict=False):
        item = entry(token, value)
        item["top_logprobs"] = [entry(t, v) for t, v in top.items()] \
            if isinstance(top, dict) else []
        content.append(item)
    return {"content": content}
