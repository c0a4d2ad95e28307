"""Witness streams: greedy streams with token ids sent through the proxy across a drill's faults.

The load generator counts tokens, not which ones. A witness stream asks for greedy
tokens and their ids (`return_token_ids`, `ignore_eos`); after the method, the same
request runs once more straight from a healthy worker (the fault-free run), and each
stream's ids must equal it: a stream the proxy moved (`x-ftctl-migrated`) and continued
token-exactly counts as cut and intact. Greedy is exact across workers of one model;
seeded sampling is not after a cut on vLLM V1 (docs/compatibility.md), so witnesses are
greedy.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.http1 import Client, HttpError, Request
from dynamo_ftctl.jsoncodec import dumps, loads
from dynamo_ftctl.sse import SseDecoder, data_and_comments

if TYPE_CHECKING:
    from dynamo_ftctl.drill.scenario import Witness
    from dynamo_ftctl.http1 import StreamingTransport

__all__ = [
    "WitnessStream",
    "compare_witnesses",
    "new_witnesses",
    "placement",
    "run_witnesses",
    "witness_body",
    "witness_counts",
]

_MIGRATED = b"x-ftctl-migrated:"  # a comment line's text
_WORKER = "x-ftctl-worker"  # the proxy's answer header: the workers the stream went to


@dataclass
class WitnessStream:
    """What one witness stream got, and how it compares with the fault-free run."""

    index: int
    body: dict[str, Any]
    ids: list[int] = field(default_factory=list)
    finished: bool = False
    migrated: bool = False
    worker: str | None = None  # the worker the proxy sent it to first (`x-ftctl-worker`)
    error: str | None = None
    reference: list[int] | None = None

    @property
    def ok(self) -> bool:
        """Answered in full: a finish reason, no error."""
        return self.error is None and self.finished

    @property
    def intact(self) -> bool:
        """Its ids are the fault-free run's."""
        return self.ok and self.reference is not None and self.ids == self.reference


def witness_body(witness: Witness, model: str, index: int) -> dict[str, Any]:
    """Request `index`: a greedy completion of its own prompt, asking for token ids."""
    from dynamo_ftctl.loadgen.workload import synthetic_prompt

    prompt = synthetic_prompt(random.Random(f"witness-{index}"), witness.prompt_tokens)
    return {"model": model, "prompt": prompt, "max_tokens": witness.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def _stream(transport: StreamingTransport, url: str, out: WitnessStream,
                  timeout_s: float) -> None:
    """POST the stream's request to `url` and read its SSE events into `out` as they come."""
    request = Request("POST", f"{url}/v1/completions", dumps(out.body),
                      {"content-type": "application/json"}, timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            response = await transport.open_stream(request)
            try:
                if response.status != 200:
                    out.error = f"HTTP {response.status}"
                    return
                out.migrated = bool(response.header("x-ftctl-migrated"))
                out.worker = (response.header(_WORKER) or "").split(",")[0] or None
                decoder = SseDecoder()
                while chunk := await response.next_chunk():
                    for block in decoder.blocks(chunk):
                        _take(block, out)
                _take(decoder.rest(), out)
            finally:
                response.close()
    except (HttpError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}".rstrip(": ")


def _take(block: bytes, out: WitnessStream) -> None:
    """One raw SSE event (LF line ends): the proxy's migration comment, or a chunk's ids."""
    payload, comments = data_and_comments(block)
    if any(comment.startswith(_MIGRATED) for comment in comments):
        out.migrated = True
    if payload is None or not payload.startswith(b"{"):  # no data, or `[DONE]`
        return
    try:
        doc = loads(payload)
    except ValueError:
        out.error = f"malformed SSE data: {payload[:80]!r}"
        return
    if not isinstance(doc, dict):
        return
    if "error" in doc:
        out.error = f"SSE error event: {str(doc['error'])[:200]}"
        return
    for choice in doc.get("choices") or ():
        out.ids.extend(choice.get("token_ids") or ())
        if choice.get("finish_reason"):
            out.finished = True


def _given(transport: StreamingTransport | None) -> StreamingTransport:
    assert transport is not None
    return transport


def new_witnesses(witness: Witness, model: str) -> list[WitnessStream]:
    """The witness streams, not sent yet (`run_witnesses` fills them in as they go)."""
    return [WitnessStream(i, witness_body(witness, model, i)) for i in range(witness.streams)]


async def run_witnesses(witness: Witness, url: str, streams: list[WitnessStream], *,
                        transport: StreamingTransport | None = None) -> None:
    """Send every witness stream to `url` at once; each records what it got as it goes.
    Through `transport` (None: an `http1.Client` of its own, closed on return)."""
    client = Client() if transport is None else None
    chosen: StreamingTransport = client if client is not None else _given(transport)
    try:
        await asyncio.gather(*(_stream(chosen, url, s, witness.timeout_s) for s in streams))
    finally:
        if client is not None:
            await client.close()


async def compare_witnesses(witness: Witness, streams: list[WitnessStream],
                            worker_url: str, *,
                            transport: StreamingTransport | None = None) -> None:
    """Run each request once more straight from `worker_url` (no proxy, no fault),
    `witness.reference_concurrency` at a time: the reference its ids must equal.
    Through `transport` (None: an `http1.Client` of its own, closed on return)."""
    slots = asyncio.Semaphore(witness.reference_concurrency)
    client = Client() if transport is None else None
    chosen: StreamingTransport = client if client is not None else _given(transport)

    async def reference(stream: WitnessStream) -> None:
        async with slots:
            fault_free = WitnessStream(stream.index, stream.body)
            await _stream(chosen, worker_url, fault_free, witness.timeout_s)
            stream.reference = fault_free.ids if fault_free.ok else None

    try:
        await asyncio.gather(*(reference(s) for s in streams))
    finally:
        if client is not None:
            await client.close()


def witness_counts(streams: list[WitnessStream], max_tokens: int) -> dict[str, Any]:
    """Streams sent, failed, cut (migrated) and completed, cut and intact, cut and failed,
    and ids that differ."""
    done = [s for s in streams if s.ok]
    cut = [s for s in done if s.migrated]
    return {
        "streams": len(streams), "failed": len(streams) - len(done),
        "cut": len(cut), "cut_intact": sum(1 for s in cut if s.intact),
        "cut_failed": sum(1 for s in streams if s.migrated and not s.ok),
        "ids_mismatched": sum(1 for s in done if not s.intact),
        "no_reference": sum(1 for s in done if s.reference is None),
        "tokens_lost": sum(max(0, max_tokens - len(s.ids)) for s in done),
        "tokens_duplicated": sum(max(0, len(s.ids) - max_tokens) for s in done),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "first_workers": placement(streams),
    }


def placement(streams: list[WitnessStream]) -> dict[str, int]:
    """How many streams the proxy sent first to each worker (those it answered)."""
    return dict(sorted(Counter(s.worker for s in streams if s.worker).items()))
