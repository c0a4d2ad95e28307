"""The `ftctl sim` server: the engine's routes on `dynamo_ftctl.httpserver`, until a signal.

The one HTTP server of the package serves the sim (no ASGI server): its
hardening covers the sim as it covers the proxy: a head over 64 KiB is 431, a
request not read whole within `REQUEST_TIMEOUT_S` is 408, connections and
buffered request bytes are capped (see `httpserver`). What the routes answer is
in `routes`; request checks in `validation`; the streamed and whole answers in
`stream`; settings, the engine and its faults in `state`.

On SIGTERM or SIGINT the server stops accepting, lets answers in flight finish
for `SHUTDOWN_DEADLINE_S`, cancels the rest and stops the engine's step loop;
SIGINT then raises `KeyboardInterrupt` (exit 130), SIGTERM returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from dynamo_ftctl.engine.errors import DroppedByFault
from dynamo_ftctl.engine.routes import REQUEST_ID_HEADER, create_router
from dynamo_ftctl.engine.state import ServerSettings, ServerState, apply_fault, build_state
from dynamo_ftctl.engine.stream import SERVER_TTFT_FIELD
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.httpapp import loop_factory
from dynamo_ftctl.httpserver import DEFAULT_MAX_BODY, start_server
from dynamo_ftctl.redact import install_log_redaction

__all__ = ["REQUEST_ID_HEADER", "SERVER_TTFT_FIELD", "DroppedByFault",
           "ServerSettings", "ServerState", "apply_fault", "build_state", "create_router",
           "serve"]

# Between requests on a kept-alive connection.
IDLE_TIMEOUT_S = 30.0
SHUTDOWN_DEADLINE_S = 3.0


class _QuietDrops(logging.Filter):
    """Keep the server from logging a traceback for every stream the disconnect fault drops."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, DroppedByFault):
                return False
            exc = exc.__cause__ or exc.__context__
        return True


def _max_body(state: ServerState) -> int:
    """The largest request the sim takes: a KV import of a whole context, with room."""
    cfg = state.engine.config
    return max(DEFAULT_MAX_BODY, 2 * cfg.kv_bytes_per_token * cfg.max_model_len + (1 << 20))


def serve(settings: ServerSettings, *, on_ready: Callable[[str], None] | None = None) -> int:
    """Run the server in this thread until SIGINT/SIGTERM; `on_ready(url)` once serving."""
    from dynamo_ftctl.output import check_output_path, write_atomic

    if settings.pid_file is not None:
        check_output_path(settings.pid_file)  # before the model loads, not after
    state = build_state(settings)
    install_log_redaction()
    quiet = _QuietDrops()
    logging.getLogger("ftctl.httpserver").addFilter(quiet)
    received: list[int] = []
    wrote_pid = False

    async def run() -> None:
        nonlocal wrote_pid
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(signum: int) -> None:
            received.append(signum)
            stop.set()

        await state.driver.start()
        try:
            for spec in settings.faults:
                apply_fault(state, spec)
            try:
                server = await start_server(
                    create_router(state), settings.host, settings.port,
                    max_body=_max_body(state), idle_timeout_s=IDLE_TIMEOUT_S,
                    request_timeout_s=settings.request_timeout_s)
            except OSError as exc:
                msg = f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}"
                raise InvalidInput(msg) from None
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, on_signal, signum)
            try:
                if settings.pid_file is not None:
                    write_atomic(settings.pid_file, f"{os.getpid()}\n")
                    wrote_pid = True
                if on_ready is not None:
                    on_ready(server.address)
                await stop.wait()
                await server.shutdown(SHUTDOWN_DEADLINE_S)
            finally:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(signum)
        finally:
            await state.driver.stop()

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(run())
    finally:
        logging.getLogger("ftctl.httpserver").removeFilter(quiet)
        if settings.pid_file is not None and wrote_pid:  # never what it refused to replace
            settings.pid_file.unlink(missing_ok=True)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return 0
