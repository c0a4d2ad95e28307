"""`ftctl failover run`: wrap an engine as a primary or shadow that serves only with the lock.

    sleep: INIT ──/health 200──► (POST /sleep) STANDBY ──lock──► WAKING ──/wake_up──► ACTIVE
    cold:  STANDBY (no engine) ──lock──► WAKING (engine starts) ──/health 200──► ACTIVE
    auto:  sleep, and where /sleep is refused: the lock if it is free (ACTIVE at once),
           else stop the engine and go on as cold

The engine runs as a child that dies with this process (PR_SET_PDEATHSIG), and
this process holds the lock, so an engine never serves without it. The health
port answers 503 in INIT and 200 in STANDBY, WAKING and ACTIVE, with the state
as JSON (`/active`: 200 only in ACTIVE), and serves `/metrics`. Engine death at
any point exits non-zero (the lock goes with the process); a wake that takes
longer than `wake_timeout_s` exits 1. The endpoints are vLLM's sleep mode (`POST /sleep?level=1`,
`POST /wake_up`, `GET /is_sleeping`), which `ftctl sim` implements too; vLLM serves them
only with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1`, and on CPU not at all (it
refuses the flag at start-up), so there the shadow waits cold. `/sleep` and `/wake_up`
carry `Authorization: Bearer $FTCTL_ADMIN_TOKEN` (`admin_token_env`), which `ftctl sim`
requires (they abort every request in flight); when the variable is unset the wrapper
makes a random token and gives it to its engine in that variable, so the two agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.auth import ADMIN_TOKEN_ENV, bearer_headers, token_from_env
from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import CheckFailed, FtctlError, InvalidInput, LockTimeout, Unreachable
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.lock.protocol import FailoverLock, Lease, LeaseLost
from dynamo_ftctl.process import SPAWNER, Child

if TYPE_CHECKING:
    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.httpapp import BackgroundServer, Router
    from dynamo_ftctl.httpserver import Reply, Request

__all__ = [
    "STANDBY_MODES", "EngineState", "FailoverConfig", "HealthServer", "StateChange",
    "run_failover",
]

# Between /health probes of a starting engine (it has no way to tell us it is up).
_READY_POLL_S = 0.05
# Between /is_sleeping probes after /wake_up answered (vLLM remaps asynchronously).
_WAKE_POLL_S = 0.01
# How long the engine gets to exit after SIGTERM before SIGKILL.
_TERM_GRACE_S = 10.0
# How a shadow waits for the lock (see the module docstring).
STANDBY_MODES = ("auto", "sleep", "cold")
# What a /sleep refusal means, for the one line that reports it.
_NO_SLEEP_HINT = ("vLLM serves /sleep only with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1, "
                  "and has no sleep mode on CPU")


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
    standby: str = "auto"  # one of STANDBY_MODES
    admin_token_env: str = ADMIN_TOKEN_ENV  # the engine's bearer token for /sleep, /wake_up


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
    standby: str = ""  # "sleep" (engine asleep) or "cold" (no engine) once known


class HealthServer:
    """The health port: 503 in INIT and STOPPED, 200 otherwise, JSON state; `/metrics`.

    `/active` answers 200 only in ACTIVE: a readiness probe that routes traffic
    to the engine holding the lock. `/`, `/health` and any other one-segment path
    answer the state. Served by the package's HTTP server from a thread of its own
    (`httpapp.BackgroundServer`): the supervisor's loop never waits on a client.
    """

    def __init__(self, host: str, port: int, snapshot: Callable[[], StateChange],
                 *, metrics: bool = True) -> None:
        self.metrics = metrics
        self._host = host
        self._port = port
        self._snapshot = snapshot
        self._server: BackgroundServer | None = None
        # Bind once now, so a busy or bad address fails before the engine starts; the
        # server binds again in start(), after the fork (run_failover forks with one thread).
        self._check_bind()

    def _refused(self, exc: OSError) -> InvalidInput:
        msg = (f"--health-port {self._port}: cannot listen on {self._host}:{self._port}: "
               f"{exc.strerror or exc}")
        return InvalidInput(msg)

    def _check_bind(self) -> None:
        try:
            infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            raise self._refused(exc) from exc

    def app(self) -> Router:
        """The routes: the state (200 or 503), `/active`, `/metrics`."""
        from dynamo_ftctl.httpapp import Router, json_reply, metrics_reply
        from dynamo_ftctl.output import to_jsonable

        def state_reply(ok: Callable[[EngineState], bool]) -> Reply:
            change = self._snapshot()
            return json_reply(to_jsonable(change), 200 if ok(change.state) else 503)

        async def state(_: Request) -> Reply:
            return state_reply(lambda s: s not in (EngineState.INIT, EngineState.STOPPED))

        async def active(_: Request) -> Reply:  # readiness: route to the holder
            return state_reply(lambda s: s is EngineState.ACTIVE)

        async def metrics(_: Request) -> Reply:
            from dynamo_ftctl.metrics import LOCK, registry_for

            return metrics_reply(registry_for(LOCK))

        router = Router()
        router.get("/", state)
        router.get("/{path}", state)
        router.get("/active", active)
        if self.metrics:
            router.get("/metrics", metrics)
        return router

    @property
    def port(self) -> int:
        """The bound port once started (the configured one before)."""
        return self._port if self._server is None else self._server.port

    def start(self) -> None:
        """Listen and serve from a thread; `InvalidInput` if the address cannot be bound."""
        from dynamo_ftctl.httpapp import BackgroundServer

        server = BackgroundServer(self.app(), self._host, self._port)
        try:
            server.start()
        except OSError as exc:
            raise self._refused(exc) from exc
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


def _check_argv(argv: Sequence[str]) -> None:
    if not argv:
        msg = "no engine command: ftctl failover run ... -- CMD ARGS..."
        raise InvalidInput(msg)


def _start_engine(argv: Sequence[str], env: Mapping[str, str]) -> Child:
    _check_argv(argv)
    try:
        # A cold start forks with the health thread running; the child's PDEATHSIG set-up
        # touches no lock of ours. PDEATHSIG follows the forking thread: we fork on the
        # main one, so no engine outlives its lock.
        # The engine's stdout goes to our stderr: with --json, stdout carries only state lines.
        return SPAWNER.spawn(argv, stdout=sys.stderr.fileno(), env=env, stdin=None,
                             die_with_parent=True)
    except OSError as exc:
        msg = f"cannot start engine {argv[0]!r}: {exc.strerror}"
        raise InvalidInput(msg) from exc


def _stop_engine(engine: Child | None, grace_s: float = _TERM_GRACE_S) -> None:
    if engine is not None and engine.alive:
        engine.stop(grace_s)


class _Run:
    """The state machine of one wrapped engine (asyncio, one task)."""

    def __init__(self, config: FailoverConfig, lock: FailoverLock,
                 engine: Child | None,
                 on_state: Callable[[StateChange], None], clock: Clock, *,
                 engine_env: Mapping[str, str]) -> None:
        self.config = config
        self.lock = lock
        self.engine = engine
        self.engine_env = engine_env  # holds the admin token the engine checks
        self.on_state = on_state
        self.clock = clock
        self.health_port: int | None = None
        self._state = StateChange(state=EngineState.INIT, engine_id=config.engine_id,
                                  at=clock.wall(), lock=lock.name,
                                  engine_pid=engine.pid if engine else None)
        self._guard = threading.Lock()

    def snapshot(self) -> StateChange:
        with self._guard:
            return self._state

    def enter(self, state: EngineState, *, token: int | None = None, detail: str = "",
              standby: str | None = None) -> None:
        with self._guard:
            self._state = replace(
                self._state, state=state, at=self.clock.wall(), detail=detail,
                token=token if token is not None else self._state.token,
                health_port=self.health_port,
                engine_pid=self.engine.pid if self.engine else None,
                standby=standby if standby is not None else self._state.standby,
            )
            change = self._state
        self.on_state(change)

    def _engine_died(self) -> CheckFailed:
        assert self.engine is not None
        code = self.engine.returncode
        state = self.snapshot().state
        hint = ""
        if state is EngineState.INIT and "--enable-sleep-mode" in self.config.argv:
            hint = ("; vLLM exits at start-up where the platform has no sleep mode (CPU): "
                    "drop --enable-sleep-mode and use --standby cold")
        return CheckFailed(f"engine {self.config.argv[0]!r} exited with code {code} "
                           f"in state {state}{hint}")

    def _watch_engine(self) -> asyncio.Future[int]:
        engine = self.engine
        assert engine is not None
        return asyncio.ensure_future(asyncio.to_thread(engine.wait_for_exit))

    async def _wait_any(self, *futures: asyncio.Future[Any], timeout: float | None = None) -> None:
        await asyncio.wait(set(futures), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    async def _wait_ready(self, client: Client, exited: asyncio.Future[int]) -> None:
        deadline = self.clock.now() + self.config.ready_timeout_s
        url = f"{self.config.engine_url}/health"
        while True:
            if exited.done():
                raise self._engine_died()
            try:
                status, _ = await client.fetch("GET", url, timeout_s=2.0)
                if status == 200:
                    return
            except OSError:  # http1's HttpError or TimeoutError: not up yet
                pass
            if self.clock.now() >= deadline:
                msg = (f"engine not healthy at {url} within "
                       f"{self.config.ready_timeout_s:g} s (--ready-timeout)")
                raise Unreachable(msg)
            await self._wait_any(exited, timeout=_READY_POLL_S)

    async def _post(self, client: Client, path: str, timeout: float) -> int:
        try:
            status, _ = await client.fetch(
                "POST", f"{self.config.engine_url}{path}", timeout_s=timeout,
                headers=bearer_headers(self.engine_env.get(self.config.admin_token_env)))
        except TimeoutError:
            return 0
        except OSError as exc:  # http1's HttpError: refused, reset, not HTTP
            msg = f"engine {self.config.engine_url}{path}: {exc}"
            raise Unreachable(msg) from exc
        return status

    async def _wake(self, client: Client, exited: asyncio.Future[int]) -> None:
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
                status, body = await client.fetch(
                    "GET", f"{self.config.engine_url}/is_sleeping",
                    timeout_s=max(0.01, deadline - self.clock.now()))
            except OSError:  # http1's HttpError or TimeoutError
                status, body = 0, b""
            if status in (0, 404):
                return  # an engine without /is_sleeping is awake when /wake_up returns
            if status == 200 and not loads(body).get("is_sleeping", False):
                return
            if self.clock.now() >= deadline:
                raise too_slow
            await self._wait_any(exited, timeout=_WAKE_POLL_S)
            if exited.done():
                raise self._engine_died()

    async def _acquire(self, stop: asyncio.Future[int],
                       exited: asyncio.Future[int] | None = None) -> Lease | None:
        """The lease, or None when `stop` (or the engine's death) came first."""
        acquiring = asyncio.ensure_future(self.lock.aacquire(None))
        await self._wait_any(acquiring, stop, *([exited] if exited else []))
        if acquiring.done():
            lease: Lease = acquiring.result()
            return lease
        acquiring.cancel()
        with contextlib.suppress(asyncio.CancelledError, FtctlError):
            await acquiring
        if exited is not None and exited.done():
            raise self._engine_died()
        return None

    async def _serve(self, exited: asyncio.Future[int], lost: asyncio.Future[LeaseLost],
                     stop: asyncio.Future[int]) -> int:
        await self._wait_any(exited, lost, stop)
        if lost.done():
            raise lost.result()
        if exited.done():
            raise self._engine_died()
        return stop.result()

    async def _run_cold(self, client: Client, lost: asyncio.Future[LeaseLost],
                        stop: asyncio.Future[int], detail: str) -> int:
        """No engine until the lock is held; then start it and serve once it is healthy."""
        self.enter(EngineState.STANDBY, detail=detail, standby="cold")
        lease = await self._acquire(stop)
        if lease is None:
            return stop.result()
        # On this (the main) thread: PDEATHSIG.
        self.engine = _start_engine(self.config.argv, self.engine_env)
        exited = self._watch_engine()
        self.enter(EngineState.WAKING, token=lease.token,
                   detail=f"lock held after {lease.waited_s:.3f} s: engine started cold, "
                          "waiting for its /health")
        ready = asyncio.ensure_future(self._wait_ready(client, exited))
        await self._wait_any(ready, lost, stop)
        if not ready.done():
            ready.cancel()
            with contextlib.suppress(asyncio.CancelledError, FtctlError):
                await ready
            if lost.done():
                raise lost.result()
            return stop.result()
        ready.result()
        self.enter(EngineState.ACTIVE, detail="serving")
        return await self._serve(exited, lost, stop)

    async def _no_sleep(self, client: Client, exited: asyncio.Future[int],
                        lost: asyncio.Future[LeaseLost], stop: asyncio.Future[int],
                        status: int) -> int:
        """/sleep refused: strict mode stops (exit 2); auto serves or waits cold."""
        refused = (f"engine has no sleep mode ({self.config.engine_url}/sleep answered "
                   f"HTTP {status}; {_NO_SLEEP_HINT})")
        advice = "run with --standby cold (or auto)"
        if status in (401, 403):
            refused = (f"engine refused /sleep ({self.config.engine_url}/sleep answered HTTP "
                       f"{status}: it checks another admin token than "
                       f"${self.config.admin_token_env})")
            advice = "name the engine's variable with --admin-token-env"
        if self.config.standby == "sleep":
            msg = f"{refused}: {advice}"
            raise InvalidInput(msg)
        lease: Lease | None
        try:  # it is up and cannot sleep: it may serve only if the lock is free right now
            lease = await self.lock.aacquire(0)
        except LockTimeout:
            lease = None
        if lease is not None:
            self.enter(EngineState.ACTIVE, token=lease.token,
                       detail=f"{refused}; the lock was free: serving")
            return await self._serve(exited, lost, stop)
        await asyncio.to_thread(_stop_engine, self.engine)
        await exited
        self.engine = None  # cold from here: the next one starts with the lock
        return await self._run_cold(client, lost, stop,
                                    f"{refused}; engine stopped: cold standby, "
                                    "waiting for the lock")

    async def run(self, stop: asyncio.Future[int]) -> int:
        from dynamo_ftctl.http1 import Client

        loop = asyncio.get_running_loop()
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
        client = Client()
        try:
            if self.engine is None:
                return await self._run_cold(client, lost, stop,
                                            "cold: the engine starts when the lock is held")
            exited = self._watch_engine()
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
            if status == 0:
                msg = f"engine {self.config.engine_url}/sleep answered no HTTP status (timeout)"
                raise CheckFailed(msg)
            if not 200 <= status < 300:
                return await self._no_sleep(client, exited, lost, stop, status)
            self.enter(EngineState.STANDBY, detail="asleep, waiting for the lock",
                       standby="sleep")
            lease = await self._acquire(stop, exited)
            if lease is None:
                return stop.result()
            self.enter(EngineState.WAKING, token=lease.token,
                       detail=f"lock held after {lease.waited_s:.3f} s")
            await self._wake(client, exited)
            self.enter(EngineState.ACTIVE, detail="serving")
            return await self._serve(exited, lost, stop)
        finally:
            await client.close()


def run_failover(
    config: FailoverConfig, lock: FailoverLock, *,
    on_state: Callable[[StateChange], None] = lambda _change: None, clock: Clock = SYSTEM_CLOCK,
) -> int:
    """Run the engine under the lock until it dies or a signal stops it.

    Returns 0 after SIGTERM (engine stopped, lock released), 130 after SIGINT;
    raises `CheckFailed` (exit 1) when the engine dies or does not wake in
    time, `LeaseLost` (exit 5) when the lock is lost (an etcd lease, a lock file deleted
    or replaced: the engine is stopped first), `Unreachable` when the engine
    never becomes healthy, `InvalidInput` (exit 2) for a bad standby mode, and
    with `standby="sleep"` for an engine that refuses /sleep.
    """
    if config.standby not in STANDBY_MODES:
        msg = f"--standby must be one of {', '.join(STANDBY_MODES)} (got {config.standby!r})"
        raise InvalidInput(msg)
    _check_argv(config.argv)
    # Order matters: bind the port (errors before anything starts), fork the engine
    # while this process has one thread, and only then start the server thread.
    # A cold standby forks later, on the lock (see _start_engine).
    holder: dict[str, _Run] = {}

    def snapshot() -> StateChange:
        return holder["run"].snapshot()

    server = HealthServer(config.health_host, config.health_port, snapshot)
    # The engine is our child: a token we make and hand it is one both sides know.
    token = token_from_env(config.admin_token_env) or secrets.token_urlsafe(32)
    engine_env = {**os.environ, config.admin_token_env: token}
    try:
        engine = None if config.standby == "cold" else _start_engine(config.argv, engine_env)
    except BaseException:
        server.stop()
        raise
    run = _Run(config, lock, engine, on_state, clock, engine_env=engine_env)
    holder["run"] = run
    try:
        server.start()
    except BaseException:
        _stop_engine(engine)
        raise
    run.health_port = server.port

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
        except LeaseLost:
            # Within the lock's grace: the next engine runs once the stop bound has passed
            # (lock/bound.py), and this one must have stopped by then.
            _stop_engine(run.engine, getattr(lock, "term_grace_s", _TERM_GRACE_S))
            raise
        finally:
            # Before asyncio.run joins its executor: the thread waiting on the engine.
            _stop_engine(run.engine)
            if in_main:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signum)

    try:
        return asyncio.run(main())
    finally:
        _stop_engine(run.engine)
        lock.release()
        ended = (f"engine exit code {run.engine.returncode}" if run.engine
                 else "no engine running (cold standby)")
        run.enter(EngineState.STOPPED, detail=ended)
        server.stop()
