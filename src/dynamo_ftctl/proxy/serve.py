"""The migrating proxy: an OpenAI-compatible front door that keeps streams alive.

The proxy is four rooms, and a request walks through them in one direction:

- the front door (`proxy/frontdoor.py`): the `httpserver` handler; parses the
  request, admits or sheds it, answers or streams to the client;
- the migration policy (`proxy/policy.py`): picks a worker, decides after a
  failure whose fault it was (attribution, query of death, retry budget) and what
  follows (retry, re-prefill, text or KV continuation, `proxy/continuation.py`,
  `migrate/handoff.py`);
- the upstream attempt (`proxy/attempt.py`): one request on one worker, its
  answer read into the request's `StreamLedger` (`proxy/ledger.py`, the data
  the policy decides from), the fast lane to the client's socket included;
- the fleet (`proxy/fleet.py`): the workers between requests: scrapes of their
  /metrics, the canary daemon's weights, breakers, busy flags, gauges.

This module assembles them (`MigratingProxy`) and runs them (`serve`). No ASGI
server: `dynamo_ftctl.httpserver` (asyncio protocols + httptools) serves every
route, without an ASGI cycle's messages and a socket write per message, which took a
large share of the proxy's CPU and of the TTFT it added (docs/benchmarks.md,
"http_stack.py").
Upstream requests (the generations, the /metrics and /v1/models scrapes, the
canary daemon's /workers and /report) go through `dynamo_ftctl.http1.Client`:
asyncio protocols parsed by httptools with a keep-alive pool per worker, cheaper per
request than aiohttp (docs/benchmarks.md, "load.py"). https:// workers go through
aiohttp, imported only when one is in the inventory.

`ftctl proxy --procs N` runs N such proxies on one port (`proxy/procs.py`: a
parent that forks them, SO_REUSEPORT), one view of the fleet through the
`FleetBoard` (`proxy/board.py`) and one /metrics (prometheus_client's
multiprocess mode).

Routes: POST /v1/completions, /v1/chat/completions; GET /v1/models, /health,
/metrics; GET/POST /busy_threshold (POST needs the admin bearer token).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import FtctlError
from dynamo_ftctl.http1 import Client
from dynamo_ftctl.httpserver import (
    default_max_connections,
    raise_open_file_limit,
    start_server,
)
from dynamo_ftctl.migrate.handoff import KvHandoff
from dynamo_ftctl.proxy.attempt import Upstream
from dynamo_ftctl.proxy.counting import TokenCounter
from dynamo_ftctl.proxy.fleet import Fleet
from dynamo_ftctl.proxy.frontdoor import MIGRATED_HEADER, FrontDoor
from dynamo_ftctl.proxy.policy import MigrationPolicy
from dynamo_ftctl.proxy.procs import ChildRun, serve_procs
from dynamo_ftctl.redact import install_log_redaction

if TYPE_CHECKING:
    from pathlib import Path

    from dynamo_ftctl.inventory import Inventory
    from dynamo_ftctl.inventory.proxy import ProxyConfig
    from dynamo_ftctl.proxy.board import FleetBoard

__all__ = ["MIGRATED_HEADER", "MigratingProxy", "ServeResult", "serve"]

log = logging.getLogger("ftctl.proxy")


def tokenizers_of(inventory: Inventory) -> dict[str, Path]:
    """The tokenizer path of each worker that names one (`tokenizer:`)."""
    return {w.name: w.tokenizer for w in inventory.workers if w.tokenizer is not None}


class MigratingProxy:
    """One proxy process: its rooms, wired together; `front_door` is the server's handler.

    `start()` starts the fleet's scrapes; `stop()` ends them and closes the upstream
    pools. Between the two, `front_door` answers requests.
    """

    def __init__(self, inventory: Inventory, config: ProxyConfig, *,
                 clock: Clock = SYSTEM_CLOCK, board: FleetBoard | None = None) -> None:
        self.http = Client(user_agent="ftctl-proxy")
        self.fleet = Fleet(inventory, config, clock, self.http, board)
        self.kv = KvHandoff(inventory, config, clock)
        upstream = Upstream(self.http, stall_s=config.stall_timeout_s,
                            connect_timeout_s=config.connect_timeout_s, now=clock.now,
                            probe=self.fleet.confirm)
        self.counter = TokenCounter(self.http, tokenizers_of(inventory))
        self.policy = MigrationPolicy(self.fleet, upstream, self.kv, config, clock,
                                      counter=self.counter)
        self.front_door = FrontDoor(self.fleet, self.policy, config)

    async def start(self) -> None:
        """Start the scrape loop (the upstream pools open as requests come)."""
        await self.fleet.start()

    async def stop(self) -> None:
        """Stop background work and close the pools."""
        await self.fleet.stop()
        await self.http.close()
        await self.kv.aclose()


@dataclass(frozen=True)
class ServeResult:
    """What `serve` reports when the proxy stops."""

    listen: str
    workers: int
    uptime_s: float
    procs: int = 1
    restarts: int = 0  # children of `--procs N` restarted after they died


def _split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def _cannot_listen(config: ProxyConfig, exc: OSError) -> Exception:
    from dynamo_ftctl.errors import InvalidInput

    return InvalidInput(f"proxy.listen {config.listen}: cannot listen there: "
                        f"{exc.strerror or exc}")


def serve(inventory: Inventory, config: ProxyConfig, *,
          on_ready: Callable[[str], None] | None = None,
          shutdown_deadline_s: float = 5.0,
          reload: Callable[[], Inventory] | None = None) -> ServeResult:
    """Run the proxy on `config.listen` until SIGTERM or SIGINT (blocking).

    SIGHUP calls `reload` for the inventory and serves its workers from then on
    (`Fleet.apply_inventory`), dropping no stream; a file that does not load keeps the
    old workers and logs one line. Without `reload`, SIGHUP is logged and ignored.

    With `config.procs` above 1, as many processes serve the port (`proxy/procs.py`):
    SIGTERM or SIGINT stops them all within the shutdown deadline, a child that dies
    is restarted, one that dies at start-up is `ChildCrashed` (exit 1).

    The front door is `dynamo_ftctl.httpserver` (no ASGI server): on a signal it
    stops accepting, lets answers in flight finish for `shutdown_deadline_s`,
    cancels the rest and closes the upstream pools. A second signal cuts the wait
    short. SIGINT then raises `KeyboardInterrupt` (exit 130); SIGTERM returns.
    An address it cannot listen on (in use, not local) is `InvalidInput` (exit 2).
    The front door holds at most `config.max_connections` clients and
    `config.max_buffered_mib` of requests not yet answered (`httpserver`'s caps);
    the soft open-file limit is raised to the hard one first, as Go's runtime does.
    """
    if config.procs > 1:
        return _serve_procs(inventory, config, on_ready=on_ready,
                            shutdown_deadline_s=shutdown_deadline_s, reload=reload)
    return _serve_one(inventory, config, on_ready=on_ready,
                      shutdown_deadline_s=shutdown_deadline_s, reload=reload)


def _reload_inventory(proxy: MigratingProxy, reload: Callable[[], Inventory] | None) -> None:
    """SIGHUP: the inventory again; a file that does not load keeps the workers as they are."""
    if reload is None:
        log.warning("SIGHUP: no inventory file to reload; serving on as before")
        return
    try:
        inventory = reload()
        summary = proxy.fleet.apply_inventory(inventory)
        proxy.counter.tokenizers = tokenizers_of(inventory)
    except FtctlError as exc:
        log.warning("SIGHUP: inventory not reloaded, serving on as before: %s", exc)
        return
    log.warning("SIGHUP: inventory reloaded: %s", summary)


def _serve_procs(inventory: Inventory, config: ProxyConfig, *,
                 on_ready: Callable[[str], None] | None,
                 shutdown_deadline_s: float,
                 reload: Callable[[], Inventory] | None) -> ServeResult:
    host, port = _split_listen(config.listen)
    started = time.monotonic()

    def run(child: ChildRun) -> int:
        _serve_one(inventory, config, on_ready=lambda _: child.ready(),
                   shutdown_deadline_s=shutdown_deadline_s, board=child.board,
                   port=child.port, reload=reload)
        return 0

    def ready(bound: int) -> None:
        if on_ready is not None:
            on_ready(f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}")

    try:
        result = serve_procs(config.procs, host, port, [w.name for w in inventory.workers],
                             run, on_ready=ready, shutdown_deadline_s=shutdown_deadline_s)
    except OSError as exc:
        raise _cannot_listen(config, exc) from None
    if result.signum == signal.SIGINT:
        raise KeyboardInterrupt
    return ServeResult(listen=config.listen, workers=len(inventory.workers),
                       uptime_s=round(time.monotonic() - started, 3), procs=config.procs,
                       restarts=result.restarts)


# Young-generation collections every this many net allocations once serving. A request
# allocates a few hundred objects, so the default (700) would collect every couple of
# requests (docs/benchmarks.md, "proxy_peers.py", has the profile and the gain).
_GC_GEN0 = 20_000


def _steady_gc() -> None:
    """Freeze what start-up built out of the cyclic collector (modules, the fleet: never
    garbage), and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], _GC_GEN0), *threshold[1:])


def _serve_one(inventory: Inventory, config: ProxyConfig, *,
               on_ready: Callable[[str], None] | None, shutdown_deadline_s: float,
               board: FleetBoard | None = None, port: int | None = None,
               reload: Callable[[], Inventory] | None = None) -> ServeResult:
    """One proxy process (`board`/`port`: a child of `--procs N`, on the reserved port)."""
    host, listen_port = _split_listen(config.listen)
    install_log_redaction()
    fd_limit = raise_open_file_limit()
    if config.max_connections is not None and config.max_connections > \
            default_max_connections(fd_limit):
        log.warning("proxy.max_connections %d is more than the open-file limit (%d) leaves "
                    "room for (%d): past it, new clients are reset", config.max_connections,
                    fd_limit, default_max_connections(fd_limit))
    proxy = MigratingProxy(inventory, config, board=board)
    started = time.monotonic()
    received: list[int] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        hurry = asyncio.Event()

        def on_signal(signum: int) -> None:
            received.append(signum)
            (hurry if stop.is_set() else stop).set()

        await proxy.start()
        try:
            buffered = config.max_buffered_mib * 1024 * 1024
            try:
                # With `port` (a child of --procs N): SO_REUSEPORT beside its siblings.
                server = await start_server(
                    proxy.front_door, host, listen_port if port is None else port,
                    max_connections=config.max_connections, max_buffered=buffered,
                    reuse_port=port is not None)
            except OSError as exc:
                raise _cannot_listen(config, exc) from None
            proxy.front_door.budget = server  # parsed requests count in max_buffered too
            _steady_gc()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, on_signal, signum)
            loop.add_signal_handler(signal.SIGHUP, _reload_inventory, proxy, reload)
            try:
                if on_ready is not None:
                    on_ready(server.address)
                await stop.wait()
                shutdown = asyncio.ensure_future(server.shutdown(shutdown_deadline_s))
                hurried = asyncio.ensure_future(hurry.wait())
                await asyncio.wait({shutdown, hurried}, return_when=asyncio.FIRST_COMPLETED)
                if not shutdown.done():
                    await server.shutdown(0.0)
                hurried.cancel()
                await shutdown
            finally:
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    loop.remove_signal_handler(signum)
        finally:
            await proxy.stop()

    from dynamo_ftctl.httpapp import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(run())
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return ServeResult(listen=config.listen, workers=len(inventory.workers),
                       uptime_s=round(time.monotonic() - started, 3))
