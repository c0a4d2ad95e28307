"""An upstream answer's body read into the ledger: `Reader`, and what one attempt holds.

`Reader` turns an answer's body into client chunks piece by piece, recording each
chunk in the `StreamLedger`; `KvShare` is the KV blocks the attempt fills on its
worker; `UpstreamFailure` is how an attempt ends without a whole answer. No I/O and
no async code here: `attempt.py` sends the request and feeds the reader, and this
module is one of those the optional compiled build turns into C with mypyc
(`make compiled`, docs/design.md): the per-token path of every streamed request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.proxy.chunk import ErrorEvent, MalformedChunk
from dynamo_ftctl.proxy.codec import ClientPiece, loads, sse_batch
from dynamo_ftctl.proxy.errors import UpstreamFailure
from dynamo_ftctl.proxy.judgment import Outcome, OutcomeKind
from dynamo_ftctl.sse import DONE, RelayBlock, SseDecoder

if TYPE_CHECKING:
    from dynamo_ftctl.http1 import Response as UpstreamResponse
    from dynamo_ftctl.httpserver import Pusher
    from dynamo_ftctl.proxy.balancer import WorkerSlot
    from dynamo_ftctl.proxy.ledger import StreamLedger

__all__ = ["KvShare", "Reader", "UpstreamFailure", "failed", "observe_whole"]

# A worker that streams this many events in a row without a token is babbling.
_MAX_EVENTS_WITHOUT_TOKEN = 1000
# Bytes a worker may send without completing one event: more is garbage, not a token.
_MAX_EVENT_BYTES = 8 * 1024 * 1024
_DONE = DONE.encode()  # the data of the last event of an OpenAI stream


def failed(kind: OutcomeKind, message: str, **found: Any) -> UpstreamFailure:
    """The `UpstreamFailure` to raise for an attempt that ended as `kind` (`Outcome`'s fields)."""
    return UpstreamFailure(Outcome(kind, message, **found))



def observe_whole(ledger: StreamLedger, data: bytes) -> None:
    """A whole (non-streamed) answer recorded in `ledger` as one chunk and its usage.

    A chat answer's `message` stands where a chunk's `delta` does; everything else
    (ids, logprobs, finish reason, usage) has a chunk's shape already. Raises as
    `StreamLedger.observe` does.
    """
    doc = loads(data)
    if not isinstance(doc, dict):
        raise MalformedChunk("answer is not a JSON object")
    choices = doc.get("choices")
    if ledger.upstream_endpoint == "chat" and isinstance(choices, list) and choices \
            and isinstance(choices[0], dict):
        choice = dict(choices[0])
        message = choice.pop("message", None)
        if not isinstance(message, dict):
            raise MalformedChunk("chat answer without a 'message' object")
        choice["delta"] = message
        doc = {**doc, "choices": [choice, *choices[1:]]}
    before = ledger.ids_distrusted
    ledger.observe(doc, render=False)
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return
    first = choices[0] if isinstance(choices, list) and choices else None
    with_ids = isinstance(first, dict) and first.get("token_ids") is not None \
        and ledger.ids_distrusted == before
    completion = usage.get("completion_tokens")
    if not with_ids and type(completion) is int and completion >= 0:
        # Without ids, the worker's count of the whole generation is the count (a token
        # that completed a stop string has no text left, and still counts).
        ledger.attempt_textual = True
        ledger.settle_attempt(completion, "usage")
    ledger.observe({"choices": [], "usage": usage}, render=False)


class KvShare:
    """The KV blocks one attempt fills on its worker, kept in the slot's `kv_blocks`.

    Admission reads the worker's KV usage from that count between two scrapes.
    Each request's tokens are rounded up to whole blocks, as the engine allocates
    them (the sum of tokens over the block size would count up to a block per request
    too few).
    """

    __slots__ = ("_block_size", "_blocks", "_slot", "_tokens")

    def __init__(self, slot: WorkerSlot, block_size: int) -> None:
        self._slot = slot
        self._block_size = block_size
        self._tokens = 0
        self._blocks = 0

    def grow(self, tokens: int) -> None:
        """`tokens` more on the worker: the slot's count grows by the whole blocks they start."""
        self._tokens += tokens
        blocks = -(-self._tokens // self._block_size)
        self._slot.kv_blocks += blocks - self._blocks
        self._blocks = blocks

    def release(self) -> None:
        """The attempt ended: its blocks leave the slot's count (call once; again is a no-op)."""
        self._slot.kv_blocks -= self._blocks
        self._blocks = 0


class Reader:
    """One upstream answer's body turned into client chunks, piece by piece (no I/O).

    `feed` records what it finds in the ledger and returns the client chunks; it
    never raises: a failure is kept in `failure`, and `over` says the answer must
    not be read further (a failure, [DONE], or a stop string matched). The task
    (`streams.stream_attempt`) and the fast lane (`sink`) feed it in turn, in order.
    """

    __slots__ = ("_chunked", "_decoder", "_held", "_idle_events", "_kv", "_last_token",
                 "_ledger", "_name", "_now", "_render", "_stall", "_unparsed", "done", "failure")

    def __init__(self, name: str, ledger: StreamLedger, stall_s: float,
                 now: Callable[[], float], kv: KvShare) -> None:
        self._name = name
        self._ledger = ledger
        self._kv = kv
        self._stall = stall_s
        self._now = now
        self._decoder = SseDecoder()
        self._last_token = now()
        self._idle_events = 0
        self._unparsed = 0  # bytes since the last complete event
        self.done = False  # [DONE] seen
        self.failure: Exception | None = None
        self._render = ledger.client_streams
        # Relayed blocks (vendor `event:` blocks, comments) wait here until this answer's
        # first client chunk goes with them: an attempt that fails before it sends none.
        self._held: list[bytes] = []
        self._chunked = False

    @property
    def over(self) -> bool:
        """Nothing more is read: the answer ended, failed, or a stop string matched."""
        return self.done or self.failure is not None or self._ledger.stopped

    def feed(self, piece: bytes) -> list[ClientPiece]:
        """The client chunks of `piece` (several events of one read go out as one write),
        and the blocks it relays unchanged (vendor `event:` blocks, comments), in order."""
        ledger = self._ledger
        batch: list[ClientPiece] = []
        events = self._decoder.feed_relay(piece)
        start = ledger.generated_count
        if not events:
            self._unparsed += len(piece)
            if self._unparsed > _MAX_EVENT_BYTES:
                self.failure = failed(
                    "garbage", f"{self._name}: {self._unparsed:,} bytes without a complete event")
            elif self._now() - self._last_token > self._stall:
                self.failure = failed("stalled", f"{self._name}: no token for {self._stall:g} s")
            return batch
        self._unparsed = 0
        now = self._now()  # the events of one read arrived together: one clock read
        for data in events:
            if type(data) is not bytes:
                if not self._relay(data, batch):
                    break
                self._idle_events += 1  # comments alone are no sign of life
                if self._idle_events > _MAX_EVENTS_WITHOUT_TOKEN \
                        or now - self._last_token > self._stall:
                    self.failure = failed(
                        "stalled", f"{self._name}: events but no token for {self._stall:g} s")
                    break
                continue
            if len(data) < 16 and data.strip() == _DONE:
                self.done = True
                if self._held:
                    batch.extend(self._held)
                    self._held.clear()
                break
            before = ledger.generated_count
            try:
                # A non-streamed client's chunks are never sent: not rendered either.
                chunk = ledger.observe(loads(data), render=self._render)
            except (MalformedChunk, ValueError) as exc:
                self.failure = exc
                break
            if ledger.generated_count > before or ledger.finished:
                self._last_token = now
                self._idle_events = 0
            else:
                self._idle_events += 1
                if self._idle_events > _MAX_EVENTS_WITHOUT_TOKEN \
                        or now - self._last_token > self._stall:
                    self.failure = failed(
                        "stalled", f"{self._name}: events but no token for {self._stall:g} s")
                    break
            if chunk is not None:
                if self._held:
                    batch.extend(self._held)
                    self._held.clear()
                self._chunked = True
                batch.append(chunk)
            if ledger.stopped:
                break
        if ledger.generated_count != start:
            self._kv.grow(ledger.generated_count - start)
        return batch

    def _relay(self, block: RelayBlock | bytes, batch: list[ClientPiece]) -> bool:
        """Pass a block that is not a chunk on to the client, unchanged and in order; False
        when it ends the answer (`event: error`, Dynamo's way of failing a stream)."""
        assert isinstance(block, RelayBlock)
        if block.event == "error":
            text = b"\n".join(line[1:].strip() for line in block.raw.split(b"\n")
                              if line.startswith(b":")).decode("utf-8", "replace")
            self.failure = ErrorEvent(f"error event from worker: {text or 'no message'}",
                                      {"error": {"message": text}})
            return False
        if self._render:  # a client that does not stream gets one JSON answer, no events
            (batch if self._chunked else self._held).append(block.raw)
        return True

    def sink(self, resp: UpstreamResponse, pusher: Pusher) -> Callable[[bytes], bool]:
        """`resp.sink` for the fast lane: each piece parsed and written to the client at once.

        It refuses pieces while the client cannot take them (they wait for the task,
        which writes them and waits for the client), and ends itself on the piece
        that makes the reader `over` (the task then raises or finishes).
        """

        def take(piece: bytes) -> bool:
            if not pusher.writable:
                return False
            try:
                batch = self.feed(piece)
                if batch:
                    pusher.write(sse_batch(batch))
            except Exception as exc:  # a bug must not escape into the socket's callback
                self.failure = exc
            if self.over:
                resp.end_sink()
            return True

        return take

