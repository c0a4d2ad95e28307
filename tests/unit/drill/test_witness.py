"""Witness streams: token ids, finish reasons and the proxy's migration mark read from SSE
over a real loopback connection, and compared with the fault-free run."""

from __future__ import annotations

import asyncio
import json

from dynamo_ftctl.drill.scenario import Witness
from dynamo_ftctl.drill.witness import (
    compare_witnesses,
    new_witnesses,
    run_witnesses,
    witness_counts,
)
from dynamo_ftctl.http1 import MockTransport, NoConnection, Reply, Request
from tests.loopback import Server

WITNESS = Witness(streams=2, max_tokens=4, prompt_tokens=4, timeout_s=5)


def _event(ids: list[int], finish: str | None = None) -> bytes:
    doc = {"choices": [{"index": 0, "text": "x", "token_ids": ids, "finish_reason": finish}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


def _sse(pieces: list[bytes], *, end: bool = True, status: str = "200 OK",
         headers: str = ""):  # type: ignore[no-untyped-def]
    """A handler answering one POST with `pieces`, each its own chunk (so its own read)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _: int) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = json.loads(await reader.readexactly(length))
        assert body["temperature"] == 0.0
        assert body["return_token_ids"] is True
        writer.write(f"HTTP/1.1 {status}\r\n{headers}Content-Type: text/event-stream\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        for piece in pieces:
            writer.write(_chunked(piece))
            await writer.drain()
            # A pause so that the pieces mostly reach the client in reads of their own (the
            # split-event case); read together they must give the same stream.
            await asyncio.sleep(0.005)
        if end:
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    return handler


def test_a_migrated_stream_keeps_its_ids_across_split_reads() -> None:
    """Ids from every event, an event split across two reads, the migration comment, and the
    finish reason: the stream is ok, cut, and intact against an equal fault-free run."""
    event = _event([3, 4], "length")
    pieces = [_event([1]) + b"data: {\"choi", b"ces\": [{\"token_ids\": [2]}]}\n\n",
              b": x-ftctl-migrated: w2 -> w1\n\n", event[:9], event[9:] + b"data: [DONE]\n\n"]

    async def main() -> None:
        streams = new_witnesses(WITNESS, "m")
        async with Server(_sse(pieces, headers="x-ftctl-worker: w2,w1\r\n")) as proxy:
            await run_witnesses(WITNESS, proxy.url, streams)
        async with Server(_sse([_event([1, 2, 3, 4], "length")])) as worker:
            await compare_witnesses(WITNESS, streams, worker.url)
        for stream in streams:
            assert stream.error is None
            assert stream.ids == [1, 2, 3, 4]
            assert (stream.finished, stream.migrated, stream.intact) == (True, True, True)
        counts = witness_counts(streams, WITNESS.max_tokens)
        assert (counts["cut"], counts["cut_intact"], counts["failed"]) == (2, 2, 0)
        # The worker each stream went to first, from the proxy's answer header.
        assert [s.worker for s in streams] == ["w2", "w2"]
        assert counts["first_workers"] == {"w2": 2}

    asyncio.run(main())


def test_the_migrated_header_marks_a_stream_cut_and_other_ids_differ() -> None:
    """`x-ftctl-migrated` in the headers marks the stream cut; ids unlike the fault-free
    run's are not intact."""

    async def main() -> None:
        streams = new_witnesses(WITNESS, "m")
        async with Server(_sse([_event([1, 2, 9, 9], "length")],
                               headers="x-ftctl-migrated: 1\r\n")) as proxy:
            await run_witnesses(WITNESS, proxy.url, streams)
        async with Server(_sse([_event([1, 2, 3, 4], "length")])) as worker:
            await compare_witnesses(WITNESS, streams, worker.url)
        assert all(s.ok and s.migrated and not s.intact for s in streams)
        assert witness_counts(streams, WITNESS.max_tokens)["ids_mismatched"] == 2

    asyncio.run(main())


def test_errors_status_cut_body_and_no_reference_are_recorded() -> None:
    """A non-200 answer, an error event and a body cut before its end are each a failed
    stream with the reason; a fault-free run that fails leaves no reference."""

    async def main() -> None:
        streams = new_witnesses(WITNESS, "m")
        async with Server(_sse([], status="503 Service Unavailable")) as busy:
            await run_witnesses(WITNESS, busy.url, streams[:1])
        async with Server(_sse([_event([1]), b'data: {"error": "boom"}\n\n'])) as failing:
            await run_witnesses(WITNESS, failing.url, streams[1:])
        assert streams[0].error == "HTTP 503"
        assert streams[1].error == "SSE error event: boom"
        cut = new_witnesses(WITNESS, "m")
        async with Server(_sse([_event([1])], end=False)) as dying:
            await run_witnesses(WITNESS, dying.url, cut)
        assert all(s.error and not s.ok for s in cut), [s.error for s in cut]
        async with Server(_sse([_event([1])], end=False)) as dying:
            await compare_witnesses(WITNESS, cut, dying.url)
        assert all(s.reference is None for s in cut)
        assert witness_counts(cut, WITNESS.max_tokens)["failed"] == 2

    asyncio.run(main())


def test_crlf_events_and_malformed_data_are_read_as_sse() -> None:
    """CRLF line ends (split between reads) are one SSE stream through `sse.SseDecoder`;
    data that is not JSON is the stream's error, not a crash of the drill."""
    crlf = _event([1, 2]).replace(b"\n", b"\r\n")
    pieces = [crlf[:-1], crlf[-1:] + b": x-ftctl-migrated: w1 -> w2\r\n\r\n",
              _event([3, 4], "length").replace(b"\n", b"\r\n")]

    async def main() -> None:
        streams = new_witnesses(WITNESS, "m")[:1]
        async with Server(_sse(pieces)) as proxy:
            await run_witnesses(WITNESS, proxy.url, streams)
        assert (streams[0].ids, streams[0].migrated, streams[0].finished) == \
            ([1, 2, 3, 4], True, True)
        assert streams[0].error is None
        broken = new_witnesses(WITNESS, "m")[:1]
        async with Server(_sse([b"data: {not json\n\n"])) as bad:
            await run_witnesses(WITNESS, bad.url, broken)
        assert (broken[0].error or "").startswith("malformed SSE data")

    asyncio.run(main())


def test_witnesses_take_a_streaming_transport() -> None:
    """`run_witnesses(transport=MockTransport(...))`: no socket; the body read back in
    7-byte pieces is the same stream, and a refused connection is the stream's error."""
    sse = _event([1, 2]) + b": x-ftctl-migrated: w1 -> w2\n\n" + _event([3, 4], "length")

    def worker(request: Request) -> Reply:
        assert request.json()["return_token_ids"] is True
        return Reply(200, sse + b"data: [DONE]\n\n", {"x-ftctl-worker": "w1,w2"})

    def refused(request: Request) -> Reply:
        raise NoConnection(f"refused: {request.url}")

    async def main() -> None:
        streams = new_witnesses(WITNESS, "m")
        await run_witnesses(WITNESS, "http://proxy", streams,
                            transport=MockTransport(worker, chunk_size=7))
        await compare_witnesses(WITNESS, streams, "http://w",
                                transport=MockTransport(worker))
        assert all(s.ids == [1, 2, 3, 4] and s.migrated and s.intact for s in streams)
        assert [s.worker for s in streams] == ["w1", "w1"]
        gone = new_witnesses(WITNESS, "m")
        await run_witnesses(WITNESS, "http://proxy", gone, transport=MockTransport(refused))
        assert all((s.error or "").startswith("NoConnection: refused") for s in gone)

    asyncio.run(main())
