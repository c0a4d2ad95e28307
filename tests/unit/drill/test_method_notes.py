"""What a `witness_tokens` fault adds to its timeline entry: where the witnesses are, and
the proxy's routing view when none is on the fault's worker."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from dynamo_ftctl.drill.method import _placement_line, _proxy_view, _witnesses_ready
from dynamo_ftctl.drill.witness import WitnessStream
from dynamo_ftctl.httpserver import Reply, Request, start_server


def _stream(worker: str | None, *, finished: bool = False, ids: int = 0,
            max_tokens: int = 16) -> WitnessStream:
    return WitnessStream(0, {"max_tokens": max_tokens}, worker=worker, finished=finished,
                         ids=list(range(ids)))


def test_a_fault_waits_for_the_streams_on_its_own_worker_only() -> None:
    """The kill of w2 waits for w2's streams (a slow w1 must not let them finish first),
    once every stream is placed; a fault without a worker waits for all of them."""
    slow_w1, fast_w2 = _stream("w1", ids=1), _stream("w2", ids=8)
    assert _witnesses_ready([slow_w1, fast_w2], 8, "w2")
    assert not _witnesses_ready([slow_w1, fast_w2], 8, None)
    assert not _witnesses_ready([slow_w1, _stream("w2", ids=7)], 8, "w2")
    assert _witnesses_ready([slow_w1, _stream("w2", ids=3, finished=True)], 8, "w2")
    # A stream not answered yet (a slow worker's, or one still on its way to w2) holds
    # the kill of w2 until a stream of w2's is half done (8 of 16), not longer.
    assert _witnesses_ready([_stream(None), fast_w2], 8, "w2")
    assert not _witnesses_ready([_stream(None), _stream("w2", ids=8, max_tokens=192)], 8, "w2")
    assert _witnesses_ready([_stream(None), _stream("w2", ids=96, max_tokens=192),
                             _stream("w2", ids=8, max_tokens=192)], 8, "w2")
    assert _witnesses_ready([_stream(None), _stream("w2", finished=True, max_tokens=192),
                             _stream("w2", ids=8, max_tokens=192)], 8, "w2")
    assert not _witnesses_ready([_stream(None), _stream("w2", ids=2)], 8, "w2")
    # None answered on w2 yet: wait until every stream is answered (then none is there).
    assert not _witnesses_ready([slow_w1, _stream(None)], 8, "w2")
    assert _witnesses_ready([slow_w1, _stream("w1")], 8, "w2")
    assert not _witnesses_ready([_stream(None), _stream("w1", ids=8)], 8, None)
    # Tokens without a worker header (not ftctl's proxy): counted as on any worker.
    assert not _witnesses_ready([_stream(None, ids=2)], 8, "w2")
    assert _witnesses_ready([_stream(None, ids=8)], 8, "w2")


def test_placement_counts_streams_mid_stream_on_the_worker() -> None:
    streams = [_stream("w1"), _stream("w2"), _stream("w2", finished=True), _stream(None)]
    assert _placement_line(streams, "w2") == "1 of 4 mid-stream on w2 (w1 1, w2 2)"
    assert _placement_line(streams, None) == "w1 1, w2 2"
    assert _placement_line([_stream(None)], "w2") == "0 of 1 mid-stream on w2 (not started)"


def test_proxy_view_quotes_each_workers_routing_state_or_says_why_not() -> None:
    doc: dict[str, Any] = {"status": "ok", "workers": {
        "w1": {"weight": 1.0, "breaker": "closed", "busy": False, "outstanding": 6},
        "w2": {"weight": 0.0, "breaker": "open", "busy": False, "outstanding": 0}}}

    async def health(request: Request) -> Reply:
        return Reply(200, json.dumps(doc).encode(), content_type="application/json")

    async def main() -> tuple[str, str]:
        server = await start_server(health, "127.0.0.1", 0)
        url = server.address
        try:
            seen = await _proxy_view(SimpleNamespace(target_url=url))  # type: ignore[arg-type]
        finally:
            await server.shutdown(1.0)
        gone = await _proxy_view(SimpleNamespace(target_url=url))  # type: ignore[arg-type]
        return seen, gone

    seen, gone = asyncio.run(asyncio.wait_for(main(), 30))
    assert seen == ("w1 weight 1.0 breaker closed busy False outstanding 6, "
                    "w2 weight 0.0 breaker open busy False outstanding 0")
    assert gone.startswith("unknown (")
