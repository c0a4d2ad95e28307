"""The ledger of one client request: everything it has received, across workers.

A `StreamLedger` sees every chunk a worker streams for one client request and
keeps what a continuation needs: the prompt token ids and every generated
token id (or, from servers that return no ids, the generated text). It turns
upstream chunks into the chunks the client sees (one `id`, one `model`, one
`created`, no second `role` delta, no per-worker usage; any field it does not own,
such as Dynamo's `nvext`, as the worker sent it), and assembles the
endings: the usage chunk, a clean "length" finish, the whole non-streamed answer.

Token counts: with ids, one per id. Without them an attempt counts one token per
non-empty text chunk (a lower bound: one chunk may carry several tokens, and a token
that ends inside a character sends an empty one) until its count is settled: by the
worker's usage chunk, which every upstream request asks for, or by the migration
policy (`settle_attempt`, through `proxy/counting.py`) for an attempt that ended
without one. Each source is kept: `count_source` is the weakest, for the client's
`x-ftctl-count` header. The prompt's count is the first attempt's, never a text
continuation's (whose prompt holds the generated text too).

Stop strings are matched here, not by the workers: a stop string may straddle
the failure point, and no worker sees both sides of it. The upstream request
goes without `stop`; `StopFinder` runs over the whole output across workers,
holding back the text that may begin a stop string (as vLLM and `ftctl sim`
do), and the attempt cuts the upstream stream when it matches.

Data, not a driver: the upstream attempt (`proxy/attempt.py`) feeds it chunks,
the migration policy reads it and builds the next body from it
(`proxy/continuation.py`), the front door renders its endings. Pure code: no I/O.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from dynamo_ftctl.openai import StopFinder
from dynamo_ftctl.proxy.chunk import (
    MAX_TOKEN_ID,
    ErrorEvent,
    MalformedChunk,
    chat_choice,
    choice_of,
    token_ids,
)
from dynamo_ftctl.proxy.counting import CountSource, weakest

__all__ = ["LENGTH_KEYS", "Endpoint", "StreamLedger", "Usage", "new_request_id"]

log = logging.getLogger("ftctl.proxy")

Endpoint = Literal["completions", "chat"]

# The client's output limit (completions' name, chat's newer name).
LENGTH_KEYS = ("max_tokens", "max_completion_tokens")
# Request ids: a random tag per process and a counter (uuid4 costs a urandom call
# per request, which shows in the proxy's profile on short requests), laid out as a version-4
# UUID: servers that validate `X-Request-Id` as a UUID refuse anything else (400).
_ID_TAG = secrets.token_hex(8)
_ID_COUNTER = itertools.count()
# Delta fields a completion cannot reproduce (parsed tool calls, reasoning text): a chat
# that has streamed them is continued as a chat (text), not through /v1/completions.
_PARSED_DELTA_KEYS = ("tool_calls", "reasoning_content", "reasoning", "function_call")
# A chunk's fields the proxy writes itself; any other (Dynamo's `nvext`, a vendor's key)
# reaches the client as the worker sent it. `ftctl_server_ttft_ms` is the sim's own TTFT
# of one attempt: the proxy's `Server-Timing` header says it for the client's request.
_OWN_CHUNK_KEYS = frozenset({"id", "object", "created", "model", "choices", "usage",
                             "system_fingerprint", "prompt_token_ids", "ftctl_server_ttft_ms"})


def new_request_id() -> str:
    """A fresh request id in the form of a version-4 UUID (random per process, counted)."""
    n = next(_ID_COUNTER) & ((1 << 60) - 1)
    tag = _ID_TAG
    # 8-4-4-4-12 hex; "4" marks version 4 and "8"-"b" the RFC 4122 variant.
    return (f"{tag[:8]}-{tag[8:12]}-4{tag[12:15]}-{8 | (n >> 58) & 3:x}{(n >> 48) & 0x3ff:03x}"
            f"-{n & 0xffffffffffff:012x}")


@dataclass(frozen=True)
class Usage:
    """Token counts of the whole client request, every token counted once."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt and completion tokens together."""
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, int]:
        """The OpenAI `usage` object: prompt, completion and total tokens."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


def _joined(parts: list[str]) -> str:
    """`parts` as one string, left joined in `parts` (the next read costs nothing)."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""


class StreamLedger:
    """Everything one client request has received so far, across workers."""

    def __init__(self, endpoint: Endpoint, body: dict[str, Any], *, migration_limit: int = 3,
                 max_model_len: int | None = None, trace_id: str = "",
                 request_id: str = "") -> None:
        # A plain class, not a dataclass: mypyc compiles this __init__ (a dataclass's is
        # generated Python, run per request).
        self.endpoint = endpoint
        self.body = body
        self.migration_limit = migration_limit
        self.max_model_len = max_model_len
        # The client's `X-Request-Id`, echoed back (and sent to workers as
        # `X-Ftctl-Trace-Id`); a fresh UUID when the client sent none. The answer's `id`
        # is the endpoint's prefix and this.
        self.trace_id = trace_id
        self.request_id = request_id
        # The `X-Request-Id` of the current attempt: a fresh UUID per attempt, never the
        # client's, so no client can make two attempts share an id on a worker (a worker
        # that refuses a running id, 409, would fail the other's request).
        self.upstream_id: str = ""
        self.created: int = int(time.time())
        self.prompt_ids: list[int] | None = None
        self.generated_ids: list[int] = []
        self.generated_count: int = 0
        self.ids_mode: bool = True
        self.ids_distrusted: bool = False  # a worker sent ids out of range: none is used or relayed
        self.finish_reason: str | None = None
        self.migrations: int = 0
        self.attempt_tokens: int = 0
        self.prompt_tokens_reported: int | None = None
        # The current attempt's usage as its worker reported it (vLLM sends it last):
        # prompt tokens, and of those the ones whose KV it loaded instead of computing
        # (`prompt_tokens_details.cached_tokens`; None when the worker sends no details).
        self.attempt_prompt_tokens: int | None = None
        self.attempt_cached_tokens: int | None = None
        # The model's chat template (`chat_template.ChatTemplate`), when the inventory names
        # its tokenizer directory: a text chat continues through /v1/completions with it.
        self.chat_template: Any = None
        # How each attempt's tokens were counted ("ids", "usage", "tokenize", ...).
        self.count_sources: list[CountSource] = []
        # The count the client's header named when it went out (the stream's end says more).
        self.count_header: str = ""
        # This attempt sent text without ids (its count is chunks until settled), and how it
        # was settled; where its text starts in `generated_text`.
        self.attempt_textual: bool = False
        self.attempt_settled: CountSource | None = None
        self.attempt_text_start: int = 0
        # Tokens of generated text that a text continuation's prompt holds (its usage's
        # prompt_tokens less these is the client's prompt, when no attempt said it).
        self._continued_at: int | None = None
        self.logprobs: dict[str, Any] | None = None
        self.workers: list[str] = []
        # Per worker, the most of this request's context (client prompt + generated tokens)
        # an attempt of it reached there: what that worker's prefix cache may still hold.
        self.reached: dict[str, int] = {}
        # The serving worker's time to first token as the proxy saw it (request written to
        # the first byte of the answer's body): the client's TTFT less this is the proxy's.
        self.upstream_ttft_s: float | None = None
        # The endpoint of the current upstream attempt: a chat continued from token ids
        # streams from "completions" (see `continuation.continuation_request`).
        self.upstream_endpoint: Endpoint = "completions"
        # A chat delta carried a parsed field (tool calls, reasoning) a completion cannot give.
        self.parsed_deltas: bool = False
        # Trailing generated ids whose text the worker has held back so far (the first bytes
        # of a character): a continuation starts before them (see `continuation.rewind`).
        self.unsettled: int = 0
        # Ids a rewound continuation generates again that the client already has.
        self.replay: list[int] = []
        self._role_sent: bool = False
        self._prompt_ids_sent: bool = False
        self._fingerprint: str | None = None
        # Stop strings the proxy matches itself (None: the request has none).
        self.stops: StopFinder | None = StopFinder.from_body(body)
        self.stopped: bool = False  # a stop string matched: the upstream stream must be cut
        # Upstream attempts ask for one whole JSON answer, not a stream (a client that does
        # not stream, a short answer: `proxy.whole_max_tokens`); a failed one is re-run.
        self.whole: bool = False
        # Texts kept in the pieces they came in and joined when read (`_joined`): a string
        # grown by += per token is copied whole each time, quadratic in its length.
        self._text_parts: list[str] = []  # every token's
        # The text sent to the client (kept only with stop strings).
        self._client_parts: list[str] = []
        # The client's asks, read once from its body (they are looked up for every chunk).
        self._streams = bool(body.get("stream"))
        self._wants_ids = bool(body.get("return_token_ids"))
        self._max_tokens: int | None = None
        for key in LENGTH_KEYS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                self._max_tokens = value
                break
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

    # ------------------------------------------------------------------ the client's asks

    @property
    def client_wants_ids(self) -> bool:
        """The client asked for token ids (`return_token_ids`): they reach it in its chunks."""
        return self._wants_ids

    @property
    def client_streams(self) -> bool:
        """The client asked for a stream (`stream: true`), not one whole answer."""
        return self._streams

    @property
    def client_wants_usage(self) -> bool:
        """The client gets a usage: always unstreamed, streamed only with `include_usage`."""
        options = self.body.get("stream_options")
        return not self.client_streams or (
            isinstance(options, dict) and bool(options.get("include_usage"))
        )

    @property
    def generated_text(self) -> str:
        """Every token's text so far, across workers."""
        return _joined(self._text_parts)

    @property
    def max_tokens(self) -> int | None:
        """The client's output limit (`max_tokens` or `max_completion_tokens`); None without one."""
        return self._max_tokens

    @property
    def output_text(self) -> str:
        """The text the client has been given (the generated text less stop handling)."""
        return self.generated_text if self.stops is None else _joined(self._client_parts)

    @property
    def upstream_path(self) -> str:
        """The path of the current upstream attempt's endpoint."""
        return "/v1/chat/completions" if self.upstream_endpoint == "chat" else "/v1/completions"

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

    # ------------------------------------------------------------------ chunks

    def start_attempt(self, worker: str = "") -> None:
        """A new upstream stream begins on `worker` (first try, retry or continuation)."""
        self._close_attempt()
        self.attempt_tokens = 0
        self.attempt_prompt_tokens = self.attempt_cached_tokens = None
        self.attempt_textual = False
        self.attempt_settled = None
        self.attempt_text_start = len(self.generated_text)
        self.upstream_id = new_request_id()
        if worker:
            self.workers.append(worker)

    def note_migration(self) -> None:
        """Count one continuation on another worker."""
        self.migrations += 1
        if self.generated_count and not self.exact and self._continued_at is None \
                and self.prompt_ids is None and self.prompt_tokens_reported is None:
            self._continued_at = self.generated_count

    def _close_attempt(self) -> None:
        """Record how the attempt that ends was counted (`count_sources`) and how far it
        got on its worker (`reached`)."""
        if self.upstream_id and self.attempt_tokens:
            self.count_sources.append(
                (self.attempt_settled or "chunks") if self.attempt_textual else "ids")
        if self.upstream_id and self.workers:
            worker = self.workers[-1]
            context = self.client_prompt_tokens + self.generated_count
            self.reached[worker] = max(self.reached.get(worker, 0), context)

    @property
    def client_prompt_tokens(self) -> int:
        """The client's prompt in tokens, as far as known (0 when nothing said it)."""
        if self.prompt_ids is not None:
            return len(self.prompt_ids)
        return self.prompt_tokens_reported or 0

    def own_context(self, worker: str) -> int:
        """The most of this request's context `worker`'s own prefix cache can hold without
        a KV transfer: the client's prompt, or what an earlier attempt there reached
        (`cost.prefill_reuse`'s `own_tokens`). Call before the current attempt closes."""
        return max(self.client_prompt_tokens, self.reached.get(worker, 0))

    @property
    def attempt_text(self) -> str:
        """The text the current attempt generated (what the client got of it)."""
        return self.generated_text[self.attempt_text_start:]

    @property
    def count_unsettled(self) -> bool:
        """Whether the current attempt's count is text chunks, not yet made exact."""
        return self.attempt_textual and self.attempt_settled is None and bool(self.attempt_tokens)

    def settle_attempt(self, tokens: int, source: CountSource) -> None:
        """The current attempt generated `tokens` tokens (`source` says how that is known).

        Never below its non-empty chunks (each held a token at least) nor past the
        client's `max_tokens`.
        """
        tokens = max(tokens, self.attempt_tokens)
        if self._max_tokens is not None:
            tokens = min(tokens, self._max_tokens - (self.generated_count - self.attempt_tokens))
        self.generated_count += tokens - self.attempt_tokens
        self.attempt_tokens = tokens
        self.attempt_settled = source

    @property
    def count_source(self) -> CountSource:
        """How the client's token counts are known: the weakest of every attempt's."""
        sources = list(self.count_sources)
        if self.attempt_tokens:
            sources.append((self.attempt_settled or "chunks") if self.attempt_textual
                           else "ids")
        return weakest(sources)

    def observe(self, doc: Any, *, render: bool = True) -> dict[str, Any] | None:
        """Record one upstream chunk; return the chunk to send to the client, or None.

        `render=False` for a caller that sends no chunk (a client that does not stream
        gets `response()`): the return is then None or not as with rendering, but
        not a client chunk (the upstream choice stands in, uncopied).

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
        choice = choice_of(doc)
        # What a worker says of the client's prompt (once), from any attempt sent with that
        # prompt alone: the first, or a retry before any token. Only the first attempt's
        # counted before (`migrations == 0`), so after a retry the prompt's ids were
        # never known and a cut stream went on as text: other ids, other tokens.
        if self.generated_count == self.attempt_tokens:
            if self.prompt_ids is None:
                prompt_ids = doc.get("prompt_token_ids")
                if choice is not None and prompt_ids is None:
                    prompt_ids = choice.get("prompt_token_ids")
                if prompt_ids is not None:
                    checked = token_ids(prompt_ids, "prompt_token_ids")
                    if checked is None:
                        self._distrust_ids("prompt_token_ids")
                    else:
                        self.prompt_ids = list(checked)
            if self.prompt_tokens_reported is None:
                usage = doc.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                    self.prompt_tokens_reported = usage["prompt_tokens"]
        if isinstance(usage := doc.get("usage"), dict):
            self._note_attempt_usage(usage)
        if choice is None:
            # The worker's usage chunk: the proxy sends its own at the end, from counts
            # this one settles (a text attempt's) or that the ids gave already.
            usage = doc.get("usage")
            if isinstance(usage, dict):
                self._observe_usage(usage)
            return None
        return self._observe_choice(doc, choice, render)

    def _note_attempt_usage(self, usage: dict[str, Any]) -> None:
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
            self.attempt_prompt_tokens = prompt
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
            self.attempt_cached_tokens = cached

    def _observe_usage(self, usage: dict[str, Any]) -> None:
        """A worker's usage: settles a text attempt's count; a text continuation's prompt
        count, less the generated tokens it re-sent, is the client's prompt."""
        completion = usage.get("completion_tokens")
        if self.count_unsettled and type(completion) is int and completion >= 0:
            self.settle_attempt(completion, "usage")
        prompt = usage.get("prompt_tokens")
        if self.prompt_tokens_reported is None and self._continued_at is not None \
                and type(prompt) is int:
            self.prompt_tokens_reported = max(0, prompt - self._continued_at)

    def _observe_choice(self, doc: dict[str, Any], choice: dict[str, Any],
                        render: bool) -> dict[str, Any] | None:
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
                choice = chat_choice(choice, text)
        if text is not None and not isinstance(text, str):
            raise MalformedChunk("chunk text is not a string")
        ids = choice.get("token_ids")
        new_ids = token_ids(ids, "token_ids") if ids is not None else None
        if ids is not None and (new_ids is None or self.ids_distrusted):
            new_ids = None
            self._distrust_ids("token_ids")
            choice = {k: v for k, v in choice.items() if k != "token_ids"}
        if new_ids is None and text:
            self.ids_mode = False
            self.attempt_textual = True
        count = len(new_ids) if new_ids is not None else (1 if text else 0)
        limit = self._max_tokens
        if limit is not None and self.generated_count + count > limit:
            raise MalformedChunk(f"worker sent more than max_tokens={limit} tokens")
        if new_ids is not None:
            self.generated_ids.extend(new_ids)
            self.unsettled = 0 if text else self.unsettled + len(new_ids)
            if self.replay:  # the client has these ids already (see `continuation.rewind`)
                again = min(len(self.replay), len(new_ids))
                del self.replay[:again]
                new_ids = new_ids[again:]
        self.generated_count += count
        self.attempt_tokens += count
        if text:
            self._text_parts.append(text)
        if not self._streams:
            self._merge_logprobs(choice.get("logprobs"))
        finish = choice.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise MalformedChunk("finish_reason is not a string")
        if self.stops is not None:
            text, hit = self.stops.feed(text or "", final=finish is not None)
            if hit:
                finish = "stop"
                self.stopped = True
            if text:
                self._client_parts.append(text)
            choice = self._with_text(choice, text, finish)
        if finish is not None:
            self.finish_reason = finish
        if not render:
            return self._unrendered_chunk(choice, text, new_ids)
        return self._client_chunk(doc, choice, text, new_ids)

    def _distrust_ids(self, what: str) -> None:
        """The worker sent ids out of range: from now on this request goes on as text, and
        no id of the worker's reaches the client."""
        self.ids_distrusted = True
        if self.ids_mode:
            log.warning("request %s: %s sent %s out of [0, %d): continuing as text",
                        self.trace_id, self.workers[-1] if self.workers else "a worker",
                        what, MAX_TOKEN_ID)
        self.ids_mode = False

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
        if not self._wants_ids:
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
        body = self.body
        out: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.endpoint == "chat" else "text_completion",
            "created": self.created,
            "model": body["model"] if "model" in body else doc.get("model"),
            "choices": [out_choice],
        }
        if self._fingerprint is None and isinstance(doc.get("system_fingerprint"), str):
            self._fingerprint = doc["system_fingerprint"]
        if self._fingerprint is not None:
            out["system_fingerprint"] = self._fingerprint
        if self._wants_ids and self.prompt_ids is not None and not self._prompt_ids_sent:
            out["prompt_token_ids"] = self.prompt_ids
            self._prompt_ids_sent = True
        if len(doc) > 5:  # more than id, object, created, model, choices: maybe a vendor's
            for key in doc.keys() - _OWN_CHUNK_KEYS:
                out[key] = doc[key]
        return out

    def _unrendered_chunk(self, choice: dict[str, Any], text: str | None,
                          new_ids: list[int] | None) -> dict[str, Any] | None:
        """`_client_chunk`'s None or not, without the chunk (`observe(render=False)`).

        A non-streamed client's answer is `response()`, assembled from the ledger, but
        the attempt and the policy act on the first batch that has a chunk (the worker's
        first token, a migration going on): the upstream choice stands in for it.
        """
        if self.endpoint == "chat":
            delta = choice["delta"]
            keys = len(delta)
            if "role" in delta:
                if self._role_sent:
                    keys -= 1  # a second worker's role: dropped from a streamed chunk
                else:
                    self._role_sent = True
            empty = not keys and not text
        else:
            empty = not text
        if empty and choice.get("finish_reason") is None and not new_ids \
                and choice.get("logprobs") is None:
            return None
        return choice

    def _merge_logprobs(self, logprobs: Any) -> None:
        """Accumulate logprobs for a non-streamed answer (completions or chat layout)."""
        if self._streams or not isinstance(logprobs, dict):
            return
        if self.logprobs is None:
            self.logprobs = {}
        for key, value in logprobs.items():
            if isinstance(value, list):
                self.logprobs.setdefault(key, []).extend(value)

    # ------------------------------------------------------------------ endings

    @property
    def finished(self) -> bool:
        """A finish reason is recorded (a worker's, a stop string's or `finish_chunk`'s):
        the answer has ended."""
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
        if held:
            self._client_parts.append(held)
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


