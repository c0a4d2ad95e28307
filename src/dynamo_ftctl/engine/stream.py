"""A lean `text/event-stream` response: one ASGI send per chunk of the body iterator.

starlette's `StreamingResponse` runs each stream in an anyio task group beside a
disconnect listener (the ASGI 2.3 path uvicorn takes). This one does the same
job with less per-stream machinery: it sends the headers, then each chunk of
the body as it comes, and a single watcher task turns the client's
`http.disconnect` into cancelling the stream, so that the body iterator is
closed at once (the engine request is aborted by its `finally`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["EventStream"]


class EventStream(Response):
    """An SSE answer streamed from an async iterator of already-framed bytes."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[bytes, None], *, status_code: int = 200,
                 headers: Mapping[str, str] | None = None) -> None:
        self.body_iterator = body
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the body; a client that leaves cancels it (and nothing is raised)."""
        del scope  # HTTP only: the sim's routes are all HTTP
        body = self.body_iterator
        task = asyncio.current_task()
        assert task is not None
        gone = False
        ending = False

        async def watch() -> None:
            nonlocal gone
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not ending:
                        gone = True
                        task.cancel()
                    return

        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        watcher = asyncio.create_task(watch())
        try:
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            ending = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
        finally:
            ending = True
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await body.aclose()
