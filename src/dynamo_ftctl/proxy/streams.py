"""The streamed path's async generators, apart: mypyc compiles no async generator, and the
modules they belong to compile without them (`make compiled`, hatch_build.MYPYC_MODULES).

- `stream_attempt`: one streamed upstream attempt on one worker (`attempt.Upstream`'s
  streamed counterpart of `Upstream.whole`);
- `stream_generate`: one streamed request across workers, the `MigrationPolicy` steps that
  `MigrationPolicy.answer` takes for a whole answer;
- `sse_body`: the client's SSE body of a streamed answer (`frontdoor.FrontDoor`).

Nothing in the proxy imports this module but the front door: it calls the rooms below it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING

from dynamo_ftctl.http1 import Request
from dynamo_ftctl.http1 import Response as UpstreamResponse
from dynamo_ftctl.openai import error_body
from dynamo_ftctl.proxy.attempt import READ_ERRORS, answered, as_failure
from dynamo_ftctl.proxy.codec import SSE_DONE, ClientPiece, sse_batch, sse_event
from dynamo_ftctl.proxy.errors import ProxyError, StreamAborted, UpstreamFailure
from dynamo_ftctl.proxy.reader import Reader, failed

if TYPE_CHECKING:
    from dynamo_ftctl.http1 import ReplyStream
    from dynamo_ftctl.proxy.admission import WorkerLoad
    from dynamo_ftctl.proxy.attempt import Lane, Upstream
    from dynamo_ftctl.proxy.balancer import WorkerSlot
    from dynamo_ftctl.proxy.ledger import StreamLedger
    from dynamo_ftctl.proxy.policy import MigrationPolicy
    from dynamo_ftctl.proxy.tally import RequestTally

__all__ = ["COUNT_HEADER", "MIGRATED_HEADER", "sse_body", "stream_attempt", "stream_generate"]

# How long to wait for the end of an upstream body after its [DONE].
_DRAIN_S = 0.1
# The answer's migrations, and how its token counts are known: ids, usage, tokenize,
# tokenizer or chunks (`proxy/counting.py`); a stream whose count changed after its head
# says so at its end (the front door's headers, named here: it imports this module).
MIGRATED_HEADER = "x-ftctl-migrated"
COUNT_HEADER = "x-ftctl-count"


async def stream_attempt(upstream: Upstream, slot: WorkerSlot, url: str,  # noqa: PLR0917
                         body: bytes, headers: dict[str, str], ledger: StreamLedger, *,
                         load: WorkerLoad | None = None,
                         lane: Lane | None = None) -> AsyncIterator[list[ClientPiece]]:
    """Stream one upstream request; yield batches of client chunks; raise on any failure
    (`UpstreamFailure`, with the `Outcome` the judgment reads).

    Once a batch has gone out and the client's stream has a `Pusher` (`lane`), the
    upstream's pieces go to `Reader.sink` in its socket callback and straight to the
    client; the generator wakes only when the sink ends (a [DONE], a stop string, a
    failure) or refuses a piece (the client's buffer is full). Leaving early (an
    exception, `aclose()`, the client's cancellation) closes the upstream connection
    unless its answer was read to the end.
    """
    stall = upstream.stall_s
    resp: ReplyStream | None = None
    kv = upstream.share(slot, ledger, load)
    try:
        resp = await upstream.http.open_stream(Request(
            "POST", url, body, headers, stall, connect_timeout_s=upstream.connect_timeout_s))
        content_type = await answered(slot, resp, stall)
        if not content_type.startswith("text/event-stream"):
            msg = f"{slot.name} answered HTTP 200 {content_type or 'untyped'}, " \
                  "not an event stream"
            raise failed("garbage", msg)
        reader = Reader(slot.name, ledger, stall, upstream.now, kv)
        token_out = False  # the policy has seen a batch with this attempt's first token
        while piece := await resp.next_chunk(stall):
            batch = reader.feed(piece)
            if batch:
                if ledger.upstream_ttft_s is None:
                    ledger.upstream_ttft_s = resp.body_wait_s
                token_out = ledger.attempt_tokens > 0
                yield batch  # what the ledger recorded reaches the client, always
            if reader.over:
                break
            # Not before the policy has seen this attempt's first token: it counts a
            # migration and the worker's first token on it, and settles whose fault an
            # earlier failure was (a chat's role chunk comes before any token).
            if token_out and lane is not None and lane.pusher is not None \
                    and isinstance(resp, UpstreamResponse) and resp.sink is None:
                resp.sink = reader.sink(resp, lane.pusher)
        if reader.failure is not None:
            raise reader.failure
        # A stop string matched here (workers never see `stop`): closing the
        # unfinished answer below cuts the upstream, which ends the request on the
        # worker. After [DONE], read the chunked terminator so the connection goes
        # back to the pool (an unread body closes it: a new TCP connection next time).
        if reader.done and not ledger.stopped and not resp.complete:
            await resp.wait_complete(_DRAIN_S)
        if not ledger.finished:
            raise failed("garbage", f"{slot.name}: stream ended without a finish reason")
    except UpstreamFailure:
        raise
    except READ_ERRORS as exc:
        raise as_failure(slot.name, exc) from None
    finally:
        kv.release()
        if resp is not None:
            resp.close()


async def stream_generate(policy: MigrationPolicy, ledger: StreamLedger,
                          lane: Lane | None) -> AsyncGenerator[list[ClientPiece], None]:
    """Batches of client chunks of one request, across as many workers as it takes.

    Raises `ProxyError` when nothing was produced, `StreamAborted` after. With a
    `lane`, an attempt's chunks after its first batch may go straight to the client
    instead (see `stream_attempt`). The steps are `MigrationPolicy.answer`'s.
    """
    trip = policy.start(ledger)
    ended = "failure"  # how a migration under way ends when the request does
    try:
        while True:
            slot, url, data, headers = await policy.begin(trip)
            try:
                async for batch in stream_attempt(
                        policy.upstream, slot, url, data, headers, ledger,
                        load=policy.fleet.loads.get(slot.name), lane=lane):
                    policy.batch(trip, slot)
                    yield batch
                await policy.succeeded(trip, slot)
                return
            except UpstreamFailure as exc:
                if not await policy.after_failure(trip, slot, exc.outcome):
                    yield [ledger.finish_chunk("length")]
                    return
            finally:
                policy.end_attempt(trip, slot)
    except (GeneratorExit, asyncio.CancelledError):
        ended = "cancelled"
        raise
    finally:
        policy.end(trip, ended)


async def sse_body(ledger: StreamLedger, first: list[ClientPiece] | None,
                   chunks: AsyncIterator[list[ClientPiece]],
                   release: Callable[[], None], tally: RequestTally) -> AsyncIterator[bytes]:
    """The client's SSE body of a streamed answer: its batches, then the usage (when asked),
    the proxy's trailing comments and [DONE]; an error event when the stream breaks."""
    try:
        if first is not None:
            yield sse_batch(first)
        try:
            async for batch in chunks:
                yield sse_batch(batch)
        except (StreamAborted, ProxyError) as exc:
            message, kind = (str(exc), exc.kind) if isinstance(exc, StreamAborted) \
                else (str(exc.body), "worker_failed")
            tally.finish("internal")  # the client hears a 502 error event
            yield sse_event(error_body(message, type=kind, code=502))
            yield SSE_DONE
            return
        tail = sse_event(ledger.usage_chunk()) if ledger.client_wants_usage else b""
        if ledger.migrations:
            # Headers left before the stream broke: say it in an SSE comment.
            tail += f": {MIGRATED_HEADER}: {ledger.migrations}\n\n".encode()
        tally.finish("", ledger.generated_count)
        if ledger.count_source != ledger.count_header:
            tail += f": {COUNT_HEADER}: {ledger.count_source}\n\n".encode()
        yield tail + SSE_DONE
    finally:
        # The client went away (or we are done): close the upstream stream now.
        tally.finish("cancelled")  # counts only when nothing above did
        release()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
