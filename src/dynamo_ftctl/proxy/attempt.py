"""One upstream attempt: one request on one worker, its answer read into the ledger.

`streams.stream_attempt` sends one streamed request and yields batches of client
chunks until the answer ends (`Upstream.whole`: one whole answer, read into the
ledger); any failure is raised as `UpstreamFailure` (the worker failed: the request
may go on elsewhere) or `UpstreamRefused` (the worker refused the request itself, a
4xx: the client's problem). A worker has failed when the
connection is refused or reset, it answers 5xx, 408 or 429, it sends anything
that is not a valid completion chunk (bad JSON, an HTML page, an SSE error event,
more tokens than asked for), the stream ends without a finish reason, or no token
comes within `stall_timeout_s`. Nothing a failed worker sent reaches the client.

`Reader` (proxy/reader.py) turns the answer's body into client chunks piece by
piece, recording each chunk in the `StreamLedger`. Once a streamed answer's head and
first tokens are out, its later tokens take the fast lane: the upstream
`Response.sink` parses each piece in the socket's callback (`Reader.sink`, the same
code the task runs) and writes it at once through the client's `httpserver.Pusher`
(`Lane`). Per token that skips a future, a timer, a task step and three async
generators (docs/benchmarks.md, "proxy.py", has the CPU per token it saves). The
task wakes when the lane ends (a
failure, [DONE], a stop string) or gives way (the client reads slower than the worker
writes).

This room knows one worker and one answer; whose fault a failure is, and what
comes next, is the migration policy's (`proxy/policy.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.http1 import (  # StreamingTransport: a field's type, read at run time
    BodyTooLarge,
    ConnectError,
    ConnectionBroken,
    NoConnection,
    Request,
    StreamingTransport,
)
from dynamo_ftctl.http1 import Response as UpstreamResponse
from dynamo_ftctl.http1.response import read_whole
from dynamo_ftctl.proxy.chunk import ErrorEvent, MalformedChunk
from dynamo_ftctl.proxy.codec import dumps
from dynamo_ftctl.proxy.judgment import OutcomeKind
from dynamo_ftctl.proxy.reader import KvShare, Reader, UpstreamFailure, failed, observe_whole

if TYPE_CHECKING:
    from dynamo_ftctl.http1 import ReplyStream
    from dynamo_ftctl.httpserver import Pusher
    from dynamo_ftctl.proxy.admission import WorkerLoad
    from dynamo_ftctl.proxy.balancer import WorkerSlot
    from dynamo_ftctl.proxy.ledger import Endpoint, StreamLedger

__all__ = ["READ_ERRORS", "KvShare", "Lane", "Reader", "Upstream", "UpstreamFailure", "answered",
           "as_failure", "estimate_prompt_tokens"]

# An error answer's body is read for the judgment (and a 4xx's for the client) up to this.
_ERROR_BODY_LIMIT = 64 * 1024
# A whole (non-streamed) answer longer than this is garbage, not a completion.
_WHOLE_LIMIT = 8 * 1024 * 1024
# Tokens per KV block until a worker's vllm:cache_config_info says (vLLM's default on GPUs).
_DEFAULT_BLOCK_SIZE = 16


def estimate_prompt_tokens(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """Prompt length in tokens, exact for id prompts, ~4 bytes a token for text."""
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return len(prompt)
        return len(str(prompt)) // 4 + 1
    size = 0
    for message in body.get("messages", ()):
        if isinstance(message, dict):
            size += len(str(message.get("content") or "")) + 8
    return size // 4 + 1


class Lane:
    """The client's side of one streamed request: its `Pusher` once the head is out."""

    __slots__ = ("pusher",)

    def __init__(self) -> None:
        self.pusher: Pusher | None = None

    def bind(self, pusher: Pusher) -> None:
        """`Stream.on_push`: the client's stream takes pieces straight from now on."""
        self.pusher = pusher


@dataclass(frozen=True, slots=True)
class Upstream:
    """The workers' side of the proxy: one attempt at a time, through one transport
    (`http1.Client`'s pools in the proxy, a `MockTransport` in tests).

    `stall_s` bounds the wait for the answer's head and between tokens; `connect_timeout_s`
    the connection. The fast lane (`Lane`) needs `http1.Client`'s answers; another
    transport's are read by the task alone.
    """

    http: StreamingTransport
    stall_s: float
    connect_timeout_s: float
    now: Callable[[], float]
    # Why a worker fails a known-good request now, None when it answers (`Fleet.confirm`):
    # asked of a worker that keeps a whole answer waiting past `stall_s`.
    probe: Callable[[WorkerSlot], Coroutine[Any, Any, str | None]] | None = None

    def share(self, slot: WorkerSlot, ledger: StreamLedger, load: WorkerLoad | None) -> KvShare:
        """The KV blocks an attempt of `ledger` on `slot` fills: the prompt, and for a
        continuation the tokens generated before (in its prompt or its KV import)."""
        kv = KvShare(slot, load.block_size if load is not None and load.block_size
                     else _DEFAULT_BLOCK_SIZE)
        kv.grow(ledger.generated_count + (
            len(ledger.prompt_ids) if ledger.prompt_ids is not None
            else estimate_prompt_tokens(ledger.endpoint, ledger.body)))
        return kv

    async def whole(self, slot: WorkerSlot, url: str, body: bytes, headers: dict[str, str],
                    ledger: StreamLedger, *, load: WorkerLoad | None = None) -> None:
        """One whole (non-streamed) answer read into the ledger; raises as
        `streams.stream_attempt` does.

        A worker sends nothing of a whole answer before its end, so silence is no sign
        of a hang here: each `stall_s` of it, the worker is asked a known-good request
        (`probe`), and the wait ends as "stalled" when it fails that. The answer's head
        is awaited at most `stall_s` per token it may have and one more (the longest a
        stream of it could take without stalling between two tokens).
        """
        kv = self.share(slot, ledger, load)
        try:
            await self._whole(slot, url, body, headers, ledger, kv)
        except UpstreamFailure:
            raise
        except READ_ERRORS as exc:
            raise as_failure(slot.name, exc) from None
        finally:
            kv.release()

    async def _whole(self, slot: WorkerSlot, url: str,  # noqa: PLR0917
                     body: bytes, headers: dict[str, str], ledger: StreamLedger,
                     kv: KvShare) -> None:
        watch = _Watch(self, slot)
        resp: ReplyStream | None = None
        try:
            resp = await self.http.open_stream(Request(
                "POST", url, body, headers, self.stall_s * ((ledger.max_tokens or 0) + 1),
                connect_timeout_s=self.connect_timeout_s))
            data = await self._whole_body(slot, resp)
        except asyncio.CancelledError:
            if watch.took_back():
                raise failed("stalled", f"{slot.name}: {watch.why}") from None
            raise
        finally:
            watch.stop()
            if resp is not None and not resp.complete:
                resp.close()
        before = ledger.generated_count
        observe_whole(ledger, data)
        if ledger.upstream_ttft_s is None and isinstance(resp, UpstreamResponse):
            ledger.upstream_ttft_s = resp.body_wait_s
        kv.grow(ledger.generated_count - before)
        if not ledger.finished:
            raise failed("garbage", f"{slot.name}: answer without a finish reason")

    async def _whole_body(self, slot: WorkerSlot, resp: ReplyStream) -> bytes:
        content_type = await answered(slot, resp, self.stall_s)
        if not content_type.startswith("application/json"):
            msg = f"{slot.name} answered HTTP 200 {content_type or 'untyped'}, not JSON"
            raise failed("garbage", msg)
        try:
            return await read_whole(resp, _WHOLE_LIMIT, self.stall_s)
        except BodyTooLarge:
            raise failed("garbage", f"{slot.name}: answer larger than "
                                    f"{_WHOLE_LIMIT:,} bytes") from None


class _Watch:
    """The watch over one whole answer's wait (from its creation to `stop`): every
    `stall_s`, a known-good probe of the worker (`Upstream.probe`); when the worker fails
    it, `why` says so and the waiting task is cancelled (`took_back` tells that
    cancellation from any other). One timer a request, no `asyncio.timeout` (run per
    request, its Python costs more than the rest of this watch)."""

    __slots__ = ("_handle", "_probe", "_probing", "_slot", "_stall", "_task", "why")

    def __init__(self, upstream: Upstream, slot: WorkerSlot) -> None:
        self._probe = upstream.probe
        self._stall = upstream.stall_s
        self._slot = slot
        self._handle: asyncio.TimerHandle | None = None
        self._probing: asyncio.Task[str | None] | None = None
        self._task: asyncio.Task[Any] | None = None
        self.why = ""
        if self._probe is not None:
            self._task = asyncio.current_task()
            self._handle = asyncio.get_running_loop().call_later(self._stall, self._check)

    def stop(self) -> None:
        """The wait ended: no more probes, no cancellation."""
        self._task = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._probing is not None:
            self._probing.cancel()
            self._probing = None

    def took_back(self) -> bool:
        """Whether the `CancelledError` being handled is this watch's own, taken back now
        (False: someone else cancelled the task too, e.g. the client left)."""
        return bool(self.why) and self._task is not None and self._task.uncancel() == 0

    def _check(self) -> None:
        self._handle = None
        assert self._probe is not None
        self._probing = asyncio.get_running_loop().create_task(self._probe(self._slot))
        self._probing.add_done_callback(self._checked)

    def _checked(self, probing: asyncio.Task[str | None]) -> None:
        if probing is not self._probing or self._task is None:
            return  # stopped meanwhile
        self._probing = None
        failure = None if probing.cancelled() else (
            repr(probing.exception()) if probing.exception() is not None
            else probing.result())
        if failure is None:
            self._handle = asyncio.get_running_loop().call_later(self._stall, self._check)
            return
        self.why = (f"no whole answer within {self._stall:g} s, and the worker fails a "
                    f"known-good request: {failure}")
        self._task.cancel()


async def answered(slot: WorkerSlot, resp: ReplyStream, stall_s: float) -> str:
    """The content type of an answer that is a 200; raise the failure of any other status
    (its body read for the judgment, and a 4xx's for the client)."""
    status = resp.status or 0
    content_type = resp.header("content-type") or ""
    if status != 200:
        raise failed("status", f"HTTP {status} from {slot.name}", status=status,
                     body=await _error_body(resp, stall_s),
                     content_type=content_type or "application/json",
                     retry_after=resp.header("retry-after"))
    return content_type


# What reading an answer raises besides `UpstreamFailure`: `as_failure` turns each into one.
READ_ERRORS = (ErrorEvent, MalformedChunk, ValueError, UnicodeDecodeError, OSError,
               TimeoutError)


def as_failure(worker: str, exc: Exception) -> UpstreamFailure:
    """The failure an attempt on `worker` ended with, from what its reading raised: an
    error event, a malformed answer, or the transport's error."""
    if isinstance(exc, ErrorEvent):
        return failed("event", f"{worker}: {exc}", status=exc.status, body=dumps(exc.doc))
    if isinstance(exc, OSError | TimeoutError):
        # OSError: http1.HttpError (refused, reset, cut, not HTTP, too large).
        kind = type(exc).__name__
        return failed(_transport_kind(exc), f"{worker}: {kind}: {exc}".rstrip(": "))
    return failed("garbage", f"{worker}: {exc}")  # MalformedChunk, ValueError, Unicode...


def _transport_kind(exc: OSError | TimeoutError) -> OutcomeKind:
    """How a transport error ended an attempt: a connection never made says nothing of the
    request; one lost once the request went out may be a worker that crashes on it."""
    if isinstance(exc, NoConnection):
        return "unreachable"
    if isinstance(exc, ConnectError | ConnectionBroken):
        return "lost"
    if isinstance(exc, TimeoutError):
        return "stalled"
    return "garbage"  # not HTTP, a body past its limit


async def _error_body(resp: ReplyStream, stall_s: float) -> bytes:
    """An error answer's body; b"" when it cannot be read or runs past `_ERROR_BODY_LIMIT`."""
    try:
        return await read_whole(resp, _ERROR_BODY_LIMIT, stall_s)
    except (OSError, TimeoutError):  # BodyTooLarge is an http1.HttpError, an OSError
        return b""

