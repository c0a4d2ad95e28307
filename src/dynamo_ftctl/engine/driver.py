"""The async driver: runs `Engine.step` in a worker thread and fans tokens out to streams.

One asyncio task loops while there is work: it takes the engine lock, runs one
step in a single-thread executor (torch releases the GIL, so the event loop
keeps serving HTTP meanwhile), and puts each token event on its request's
queue; while idle it frees retained KV blocks as they lapse. Everything that must
see the engine between steps (KV export/import, sleep/wake) takes the same lock.
The `slow` fault sleeps after each step, the `hang` fault stalls the loop on an
event, a contained Xid ends one running request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from dynamo_ftctl.engine.faults import FaultState
from dynamo_ftctl.engine.scheduler import Engine, EngineRequest, TokenEvent

if TYPE_CHECKING:
    from dynamo_ftctl.engine.metrics import EngineMetrics

__all__ = ["AsyncEngine"]

_log = logging.getLogger("ftctl.sim")
T = TypeVar("T")
# Past a retained request's deadline (`retained_until` is a strict bound), so that the
# timer's wake-up finds it lapsed.
_EXPIRY_SLACK_S = 0.001


class AsyncEngine:
    """An `Engine` driven from asyncio: `generate` yields a request's token events."""

    def __init__(self, engine: Engine, faults: FaultState, metrics: EngineMetrics) -> None:
        self.engine = engine
        self.faults = faults
        self.metrics = metrics
        self.lock = asyncio.Lock()
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ftctl-sim-engine")
        self._task: asyncio.Task[None] | None = None
        self.ready = False

    async def start(self) -> None:
        """Start the step loop."""
        import torch

        # Warm up kernels outside any request's latency: one forward of each shape family.
        await self.run_locked(self._warm_up)
        torch.set_grad_enabled(False)
        self._task = asyncio.create_task(self._run(), name="ftctl-sim-steps")
        self.ready = True

    def _warm_up(self) -> None:
        from dynamo_ftctl.engine.scheduler import RequestParams

        for prompt_len in (1, 64):
            request = self.engine.new_request([65] * prompt_len, RequestParams(max_tokens=2))
            self.engine.submit(request)
            while self.engine.has_work():
                self.engine.step()

    async def stop(self) -> None:
        """Stop the step loop and the worker thread."""
        self.ready = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def run_locked(self, fn: Callable[[], T]) -> T:
        """Run `fn` in the engine thread between steps."""
        loop = asyncio.get_running_loop()
        async with self.lock:
            return await loop.run_in_executor(self._executor, fn)

    async def _run(self) -> None:
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                if not self.engine.has_work():
                    await self._idle()
            if not self.faults.serving.is_set():  # the hang fault: stall, loop stays free
                await self.faults.serving.wait()
            self.engine.corrupt_logits = self.faults.sdc
            self.engine.poison_seed = self.faults.poison_seed
            self._deliver(self.faults.take_contained(self.engine))
            try:
                async with self.lock:
                    # Inline, not in the executor: a step is a few ms, and handing it to a
                    # thread costs GIL switches (5 ms interval) that add to every TTFT.
                    events = self.engine.step()
            except Exception:
                _log.exception("engine step failed; failing the running requests")
                events = self._fail_all("engine step failed")
            self._deliver(events)
            delay = self.faults.delay_s
            await (asyncio.sleep(delay) if delay > 0 else asyncio.sleep(0))

    async def _idle(self) -> None:
        """Wait for work; meanwhile free retained KV as it lapses (no step would)."""
        while True:
            async with self.lock:  # an export or import may be changing `retained`
                due = self.engine.next_expiry()
            if due is None:
                await self._wake.wait()
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - time.monotonic()) + _EXPIRY_SLACK_S):
                    await self._wake.wait()
                    return
            async with self.lock:
                self.engine.expire_retained()

    def _fail_all(self, reason: str) -> list[TokenEvent]:
        events = []
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            events.append(TokenEvent(request_id, None, "abort", reason))
        return events

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self._streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
            if event.token is not None:
                self.metrics.generation_tokens.inc()
            if event.finish_reason is not None:
                self.metrics.request_success.labels(
                    finished_reason=event.finish_reason).inc()

    def fail(self, request_ids: list[str], reason: str) -> None:
        """Tell these requests' streams that they ended with an error."""
        self._deliver([TokenEvent(rid, None, "abort", reason) for rid in request_ids])

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """Submit `request` and yield its events until it finishes (or the caller stops).

        When the caller stops early (client gone, stream dropped by a fault), the
        request is aborted and its KV blocks are retained for export a while.
        """
        async for event in self.follow(request, lambda: self.engine.submit(request)):
            yield event

    async def follow(
        self, request: EngineRequest, start: Callable[[], object],
    ) -> AsyncIterator[TokenEvent]:
        """Register a stream for `request`, call `start`, then yield its events."""
        async for batch in self.follow_batches(request, start):
            for event in batch:
                yield event

    async def follow_batches(
        self, request: EngineRequest, start: Callable[[], object],
    ) -> AsyncIterator[list[TokenEvent]]:
        """Like `follow`, but yields every event already waiting at once (one write each).

        A stream that fell behind the step loop (a busy event loop, a slow client)
        catches up in one batch instead of one wake-up per token.
        """
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[request.request_id] = queue
        finished = False
        self.metrics.prompt_tokens.inc(len(request.token_ids) - request.num_cached)
        try:
            start()
            self._wake.set()
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for i, event in enumerate(batch):
                    if event.finish_reason is not None or event.error is not None:
                        finished = True
                        del batch[i + 1:]
                        break
                yield batch
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.engine.abort(request.request_id, retain=True)
                self._wake.set()

    def wake_loop(self) -> None:
        """Nudge the step loop (after an import or an abort)."""
        self._wake.set()
