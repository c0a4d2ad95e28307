"""`ftctl failover run`: wrap an engine as a primary or shadow that serves only with the lock.

    INIT ──/health 200──► (POST /sleep) STANDBY ──lock──► WAKING ──/wake_up──► ACTIVE

The engine runs as a child that dies with this process (PR_SET_PDEATHSIG), and
this process holds the lock, so an engine never serves without it. The health
port answers 503 in INIT and 200 in STANDBY, WAKING and ACTIVE, with the state
as JSON (`/active`: 200 only in ACTIVE), and serves `/metrics`. Engine death at
any point exits non-zero (the lock goes with the process); a wake that takes
longer than `wake_timeout_s` exits 1. The endpoints are vLLM's sleep mode (`POST /sleep?level=1`,
`POST /wake_up`, `GET /is_sleeping`), which `ftctl sim` implements too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import CheckFailed, FtctlError, InvalidInput, Unreachable
from dynamo_ftctl.lock.protocol import FailoverLock, LeaseLost

if TYPE_CHECKING:
    import httpx

__all__ = ["EngineState", "FailoverConfig", "HealthServer", "StateChange", "run_failover"]

# Between /health probes of a starting engine (it has no way to tell us it is up).
_READY_POLL_S = 0.05
# Between /is_sleeping probes after /wake_up answered (vLLM remaps asynchronously).
_WAKE_POLL_S = 0.01
# How long the engine gets to exit after SIGTERM before SIGKILL.
_TERM_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


class EngineState(enum.StrEnum):
    """Where the wrapped engine is in its life."""

    INIT = "INIT"
    STANDBY = "STANDBY"
    WAKING = "WAKING"
    ACTIVE = "ACTIVE"
    STOPPED = "STOPPED"


@dataclass(frozen=True)
class FailoverConfig:
    """One `ftctl failover run`: the engine command, its URL and the health port."""

    argv: tuple[str, ...]
    engine_id: int
    engine_url: str = "http://127.0.0.1:8000"
    health_host: str = "127.0.0.1"
    health_port: int = 0
    ready_timeout_s: float = 600.0
    wake_timeout_s: float = 30.0
    sleep_level: int = 1


@dataclass(frozen=True)
class StateChange:
    """One transition, reported to the caller and served on the health port."""

    state: EngineState
    engine_id: int
    at: float
    lock: str
    engine_pid: int | None = None
    token: int | None = None
    health_port: int | None = None
    detail: str = ""


class HealthServer:
    """The health port: 503 in INIT and STOPPED, 200 otherwise, JSON state; `/metrics`.

    `/active` answers 200 only in ACTIVE: a readiness probe that routes traffic
    to the engine holding the lock.
    """

    def __init__(self, host: str, port: int, snapshot: Callable[[], StateChange],
                 *, metrics: bool = True) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] == "/metrics" and outer.metrics:
                    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                    from dynamo_ftctl.metrics import REGISTRY

                    self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                    return
                state = snapshot()
                if self.path.split("?", 1)[0] == "/active":  # readiness: route to the holder
                    ok = state.state is EngineState.ACTIVE
                else:
                    ok = state.state not in (EngineState.INIT, EngineState.STOPPED)
                from dynamo_ftctl.output import to_jsonable

                body = json.dumps(to_jsonable(state)).encode()
                self._reply(200 if ok else 503, body, "application/json")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # stdlib's signature
                pass

        self.metrics = metrics
        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            msg = f"--health-port {port}: cannot listen on {host}:{port}: {exc.strerror}"
            raise InvalidInput(msg) from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ftctl-failover-health", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the wrapper dies, so no engine outlives its lock."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _start_engine(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    if not argv:
        msg = "no engine command: ftctl failover run ... -- CMD ARGS..."
        raise InvalidInput(msg)
    try:
        # preexec_fn is safe here: no other thread of ours runs yet (see run_failover).
        # The engine's stdout goes to our stderr: with --json, stdout carries only state lines.
        return subprocess.Popen(list(argv), stdout=sys.stderr.fileno(),
                                preexec_fn=_die_with_parent)  # noqa: PLW1509
    except OSError as exc:
        msg = f"cannot start engine {argv[0]!r}: {exc.strerror}"
        raise InvalidInput(msg) from exc


def _stop_engine(engine: subprocess.Popen[bytes]) -> None:
    if engine.poll() is not None:
        return
    engine.terminate()
    try:
        engine.wait(_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait()


class _Run:
    """The state machine of one wrapped engine (asyncio, one task)."""

    def __init__(self, config: FailoverConfig, lock: FailoverLock, engine: subprocess.Popen[bytes],
                 on_state: Callable[[StateChange], None], clock: Clock) -> None:
        self.config = config
        self.lock = lock
        self.engine = engine
        self.on_state = on_state
        self.clock = clock
        self.health_port: int | None = None
        self._state = StateChange(state=EngineState.INIT, engine_id=config.engine_id,
                                  at=clock.wall(), lock=lock.name, engine_pid=engine.pid)
        self._guard = threading.Lock()

    def snapshot(self) -> StateChange:
        with self._guard:
            return self._state

    def enter(self, state: EngineState, *, token: int | None = None, detail: str = "") -> None:
        with self._guard:
            self._state = replace(
                self._state, state=state, at=self.clock.wall(), detail=detail,
                token=token if token is not None else self._state.token,
                health_port=self.health_port,
            )
            change = self._state
        self.on_state(change)

    def _engine_died(self) -> CheckFailed:
        code = self.engine.returncode
        return CheckFailed(f"engine {self.config.argv[0]!r} exited with code {code} "
                           f"in state {self.snapshot().state}")

    async def _wait_any(self, *futures: asyncio.Future[Any], timeout: float | None = None) -> None:
        await asyncio.wait(set(futures), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    async def _wait_ready(self, client: httpx.AsyncClient, exited: asyncio.Future[int]) -> None:
        import httpx

        deadline = self.clock.now() + self.config.ready_timeout_s
        url = f"{self.config.engine_url}/health"
        while True:
            if exited.done():
                raise self._engine_died()
            try:
                response = await client.get(url, timeout=2.0)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.clock.now() >= deadline:
                msg = (f"engine not healthy at {url} within "
                       f"{self.config.ready_timeout_s:g} s (--ready-timeout)")
                raise Unreachable(msg)
            await self._wait_any(exited, timeout=_READY_POLL_S)

    async def _post(self, client: httpx.AsyncClient, path: str, timeout: float) -> int:
        import httpx

        try:
            response = await client.post(f"{self.config.engine_url}{path}", timeout=timeout)
        except httpx.TimeoutException:
            return 0
        except httpx.HTTPError as exc:
            msg = f"engine {self.config.engine_url}{path}: {exc}"
            raise Unreachable(msg) from exc
        return response.status_code

    async def _wake(self, client: httpx.AsyncClient, exited: asyncio.Future[int]) -> None:
        import httpx

        limit = self.config.wake_timeout_s
        deadline = self.clock.now() + limit
        too_slow = CheckFailed(f"engine did not wake within {limit:g} s (--wake-timeout)")
        status = await self._post(client, "/wake_up", max(0.01, limit))
        if exited.done():
            raise self._engine_died()
        if status == 0:
            raise too_slow
        if not 200 <= status < 300:
            msg = f"engine {self.config.engine_url}/wake_up answered HTTP {status}"
            raise CheckFailed(msg)
        while True:  # vLLM answers /wake_up before the weights are remapped
            try:
                response = await client.get(f"{self.config.engine_url}/is_sleeping",
                                            timeout=max(0.01, deadline - self.clock.now()))
            except httpx.HTTPError:
                response = None
            if response is None or response.status_code == 404:
                return  # an engine without /is_sleeping is awake when /wake_up returns
            if response.status_code == 200 and not response.json().get("is_sleeping", False):
                return
            if self.clock.now() >= deadline:
                raise too_slow
            await self._wait_any(exited, timeout=_WAKE_POLL_S)
            if exited.done():
                raise self._engine_died()

    async def run(self, stop: asyncio.Future[int]) -> int:
        import httpx

        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = asyncio.ensure_future(asyncio.to_thread(self.engine.wait))
        lost: asyncio.Future[LeaseLost] = loop.create_future()

        def tell_lost(exc: LeaseLost) -> None:
            def settle() -> None:
                if not lost.done():
                    lost.set_result(exc)

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle)

        set_on_lost = getattr(self.lock, "set_on_lost", None)
        if set_on_lost is not None:
            set_on_lost(tell_lost)
        async with httpx.AsyncClient() as client:
            self.enter(EngineState.INIT, detail="waiting for the engine's /health")
            ready = asyncio.ensure_future(self._wait_ready(client, exited))
            await self._wait_any(ready, stop)
            if stop.done():
                ready.cancel()
                return stop.result()
            ready.result()
            status = await self._post(client, f"/sleep?level={self.config.sleep_level}",
                                      self.config.wake_timeout_s)
            if exited.done():
                raise self._engine_died()
            if not 200 <= status < 300:
                msg = f"engine {self.config.engine_url}/sleep answered HTTP {status or 'timeout'}"
                raise CheckFailed(msg)
            self.enter(EngineState.STANDBY, detail="asleep, waiting for the lock")
            acquiring = asyncio.ensure_future(self.lock.aacquire(None))
            await self._wait_any(acquiring, exited, stop)
            if not acquiring.done():
                acquiring.cancel()
                with contextlib.suppress(asyncio.CancelledError, FtctlError):
                    await acquiring
                if exited.done():
                    raise self._engine_died()
                return stop.result()
            lease = acquiring.result()
            self.enter(EngineState.WAKING, token=lease.token,
                       detail=f"lock held after {lease.waited_s:.3f} s")
            await self._wake(client, exited)
            self.enter(EngineState.ACTIVE, detail="serving")
            await self._wait_any(exited, lost, stop)
            if lost.done():
                raise lost.result()
            if exited.done():
                raise self._engine_died()
            return stop.result()


def run_failover(
    config: FailoverConfig, lock: FailoverLock, *,
    on_state: Callable[[StateChange], None] = lambda _change: None, clock: Clock = SYSTEM_CLOCK,
) -> int:
    """Run the engine under the lock until it dies or a signal stops it.

    Returns 0 after SIGTERM (engine stopped, lock released), 130 after SIGINT;
    raises `CheckFailed` (exit 1) when the engine dies or does not wake in
    time, `LeaseLost` when an etcd lease is lost, `Unreachable` when the engine
    never becomes healthy.
    """
    # Order matters: bind the port (errors before anything starts), fork the engine
    # while this process has one thread, and only then start the server thread.
    holder: dict[str, _Run] = {}

    def snapshot() -> StateChange:
        return holder["run"].snapshot()

    server = HealthServer(config.health_host, config.health_port, snapshot)
    try:
        engine = _start_engine(config.argv)
    except BaseException:
        server.stop()
        raise
    run = _Run(config, lock, engine, on_state, clock)
    run.health_port = server.port
    holder["run"] = run
    server.start()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[int] = loop.create_future()
        in_main = threading.current_thread() is threading.main_thread()

        def request_stop(code: int) -> None:
            if not stop.done():
                stop.set_result(code)

        if in_main:
            for signum, code in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
                loop.add_signal_handler(signum, request_stop, code)
        try:
            return await run.run(stop)
        finally:
            # Before asyncio.run joins its executor: the thread waiting on the engine.
            _stop_engine(engine)
            if in_main:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signum)

    try:
        return asyncio.run(main())
    finally:
        _stop_engine(engine)
        lock.release()
        run.enter(EngineState.STOPPED, detail=f"engine exit code {engine.returncode}")
        server.stop()
