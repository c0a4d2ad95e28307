"""The migrating proxy: an OpenAI-compatible front door that keeps streams alive.

`build_app(inventory, config)` returns the ASGI app (`ProxyApp`: the two
generation routes go straight to the proxy, everything else through a
Starlette router), for any ASGI server and the tests. `serve(...)` runs no ASGI
server: `dynamo_ftctl.httpserver` (asyncio protocols + httptools) answers the
generation routes with `front_door` and hands only the other routes to the
Starlette router; under uvicorn, the ASGI messages and a socket write per
message were ~40% of the proxy's CPU and most of the TTFT it added (py-spy,
benchmarks/proxy.py). Upstream requests (the
generations, the /metrics and /v1/models scrapes, the canary daemon's /workers
and /report) go through `dynamo_ftctl.http1.Client`: asyncio protocols parsed
by httptools with a keep-alive pool per worker, the load generator's client.
It costs a third of aiohttp's CPU per request (aiohttp was ~22% of the proxy's
CPU in py-spy; benchmarks/proxy.py). https:// workers go through aiohttp,
imported only when one is in the inventory. KV exports keep their httpx client
(`migrate.transfer`, one call per migration).

Once a streamed answer's head and first tokens are out, its later tokens take
the fast lane: the upstream `Response.sink` parses each piece in the socket's
callback (`_Reader`, the same code the task runs) and writes it at once through
the client's `httpserver.Pusher`. Per token that skips a future, a timer, a
task step and three async generators: ~25% less proxy CPU per streamed token
(its CPU time over the tokens it relayed, 32 streams, against the task path).
The task wakes when the lane ends (a failure, [DONE], a stop string) or gives
way (the client reads slower than the worker writes).

Every upstream request is streamed with token ids, even when the client asked
for one JSON answer, so that a generation broken half-way can go on elsewhere
(`continuation.StreamLedger`). A worker has failed when the connection is
refused or reset, it answers 5xx, 408 or 429, it sends anything that is not a
valid completion chunk (bad JSON, an HTML page, an SSE error event, more tokens
than asked for), the stream ends without a finish reason, or no token comes
within `stall_timeout_s`. Nothing a failed worker sent reaches the client.

Failure attribution: a 4xx (but 408 and 429, which say the worker is loaded),
as an answer or as an SSE error event's code, is the request's fault: it goes
to the client, and the worker counts it as an answer, not a failure. A 5xx
(but 502-504), an error event without such a code, or a connection lost after
the request went out and before the attempt's first token may be either's
fault: the request goes to another worker, and the failure is charged (breaker,
canary daemon report) once that worker's outcome says whose it was. If the
request fails there the same way (same status, same kind of event, or its
connection lost again before a token), it is a query of death: the client
gets a 502 of type `query_of_death`, no further worker is tried, and neither
worker is charged (`ftctl_proxy_query_of_death_total`). A stream cut after its
first tokens (a killed worker) is charged at once and never counts towards a
query of death. Retries of requests with no output yet are capped by
`proxy.retry_budget` (Envoy's retry budget): past it the request fails with a
503 of type `retry_budget_exhausted` (`ftctl_proxy_retry_budget_exhausted_total`).

A broken generation goes on elsewhere by re-prefill (prompt + generated ids,
`method="reprefill"`), by text continuation for servers without token ids
(`method="text"`, docs/design.md "Continuation"), or by KV transfer
(`method="kv"`): with a calibration (`ftctl migrate calibrate`) whose cost
model says a transfer is faster, the failed worker's KV is exported
(`migrate.transfer.export_request`, the same call as `ftctl migrate request`)
and imported on the target, which streams the continuation. A SIGKILLed
worker has nothing to export; any failure of the export or the import falls
back to re-prefill. A plain retry before the first token is `method="retry"`.

Routes: POST /v1/completions, /v1/chat/completions; GET /v1/models, /health,
/metrics; GET/POST /busy_threshold (POST needs the admin bearer token).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_ftctl.auth import bearer_headers, check_bearer, token_from_env
from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.http1 import AnyResponse, Client, ConnectError, ConnectionBroken, Unreachable
from dynamo_ftctl.http1 import Response as UpstreamResponse
from dynamo_ftctl.httpserver import (
    Pusher,
    Reply,
    Stream,
    call_asgi,
    default_max_connections,
    raise_open_file_limit,
    start_server,
)
from dynamo_ftctl.migrate.admission import (
    BUSY_BODY,
    Thresholds,
    decide,
    degradation_level,
    is_busy,
    parse_priority,
    parse_worker_load,
)
from dynamo_ftctl.migrate.continuation import (
    Endpoint,
    ErrorEvent,
    MalformedChunk,
    NotContinuable,
    RequestRejected,
    StreamLedger,
    prepare_request,
)
from dynamo_ftctl.migrate.routing import Router, WorkerSlot, parse_daemon_weights
from dynamo_ftctl.openai import SseDecoder, error_body, parse_request_json
from dynamo_ftctl.redact import install_log_redaction

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from dynamo_ftctl.capabilities import CapabilityCache
    from dynamo_ftctl.httpserver import Handler
    from dynamo_ftctl.httpserver import Request as HttpRequest
    from dynamo_ftctl.inventory import Inventory, ProxyConfig
    from dynamo_ftctl.migrate.admission import WorkerLoad
    from dynamo_ftctl.migrate.calibrate import Calibration

__all__ = ["MIGRATED_HEADER", "MigratingProxy", "build_app", "serve"]

log = logging.getLogger("ftctl.proxy")

MIGRATED_HEADER = "x-ftctl-migrated"
CONTINUATION_HEADER = "x-ftctl-continuation"
WORKER_HEADER = "x-ftctl-worker"
# The serving worker's time to first token as the proxy saw it (W3C Server-Timing).
TIMING_HEADER = "Server-Timing"
PRIORITY_HEADER = "x-ftctl-priority"

# A worker that streams this many events in a row without a token is babbling.
_MAX_EVENTS_WITHOUT_TOKEN = 1000
_SSE_DONE = b"data: [DONE]\n\n"
# How long to wait for the end of an upstream body after its [DONE].
_DRAIN_S = 0.1
# Bytes a worker may send without completing one event: more is garbage, not a token.
_MAX_EVENT_BYTES = 8 * 1024 * 1024
# Statuses that say the worker is loaded, unavailable or lost behind a gateway, not
# that the request is bad: worth a try elsewhere, and no sign of a query of death.
_UNAVAILABLE_STATUSES = frozenset({408, 429, 502, 503, 504})
# Tokens per KV block until a worker's vllm:cache_config_info says (vLLM's default on GPUs).
_DEFAULT_BLOCK_SIZE = 16


# msgspec: ~10x json's speed on a token chunk (1 vs 14 us to encode, 2.5 vs 11 us
# to decode), paid twice per token on the proxy's one core.
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def _dumps(doc: Any) -> bytes:
    try:
        return _ENCODER.encode(doc)
    except UnicodeEncodeError:
        # Byte-level engines put undecodable bytes in text as lone surrogates
        # (\udcfc), which only an ASCII-escaped JSON string can carry back.
        return json.dumps(doc, separators=(",", ":")).encode()


def _loads(data: str | bytes) -> Any:
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)  # lone-surrogate escapes, which msgspec refuses


def _sse(doc: Any) -> bytes:
    return b"data: " + _dumps(doc) + b"\n\n"


def _sse_batch(batch: list[dict[str, Any]]) -> bytes:
    """One write's worth of client chunks as SSE events."""
    return b"".join(map(_sse, batch))


def _openai_error(message: str, kind: str, code: int) -> dict[str, Any]:
    return error_body(message, type=kind, code=code)


class UpstreamFailure(Exception):
    """The worker failed this attempt (the request may go on elsewhere).

    `way` names how when the request itself may be the cause ("HTTP 500", "error
    event", "connection lost"): the same way on two workers is a query of death.
    None when the failure says nothing about the request (a refused connection, a
    timeout, garbage, a load status). `gone`: the worker went away (refused or dropped
    the connection) rather than answered; retrying such a request moves load and does
    not multiply it, so the retry budget does not cap it.
    """

    def __init__(self, message: str, way: str | None = None, *, gone: bool = False) -> None:
        super().__init__(message)
        self.way = way
        self.gone = gone


@dataclass(frozen=True)
class UpstreamRefused(Exception):
    """The worker refused the request itself (4xx): the client's problem, passed through."""

    status: int
    body: bytes
    content_type: str


class ProxyError(Exception):
    """A failure before any output: answered as an HTTP error."""

    def __init__(self, status: int, body: dict[str, Any],
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body
        self.headers = dict(headers or {})


class StreamAborted(Exception):
    """A failure after output began: ends the stream with an error event of type `kind`."""

    def __init__(self, message: str, kind: str = "worker_failed") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class _Suspect:
    """A failure that may be the request's doing, charged to `slot` only once it is not."""

    slot: WorkerSlot
    reason: str
    way: str


def _estimate_prompt_tokens(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """Prompt length in tokens, exact for id prompts, ~4 bytes a token for text."""
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return len(prompt)
        return len(str(prompt)) // 4 + 1
    size = 0
    for message in body.get("messages", ()):
        if isinstance(message, dict):
            size += len(str(message.get("content") or "")) + 8
    return size // 4 + 1


class Lane:
    """The client's side of one streamed request: its `Pusher` once the head is out."""

    __slots__ = ("pusher",)

    def __init__(self) -> None:
        self.pusher: Pusher | None = None

    def bind(self, pusher: Pusher) -> None:
        """`Stream.on_push`: the client's stream takes pieces straight from now on."""
        self.pusher = pusher


class _KvShare:
    """The KV blocks one attempt fills on its worker, kept in the slot's `kv_blocks`.

    Admission reads the worker's KV usage from that count between two scrapes.
    Each request's tokens are rounded up to whole blocks, as the engine allocates
    them (the sum of tokens over the block size ran up to a block per request low).
    """

    __slots__ = ("_block_size", "_blocks", "_slot", "_tokens")

    def __init__(self, slot: WorkerSlot, block_size: int) -> None:
        self._slot = slot
        self._block_size = block_size
        self._tokens = 0
        self._blocks = 0

    def grow(self, tokens: int) -> None:
        self._tokens += tokens
        blocks = -(-self._tokens // self._block_size)
        self._slot.kv_blocks += blocks - self._blocks
        self._blocks = blocks

    def release(self) -> None:
        self._slot.kv_blocks -= self._blocks
        self._blocks = 0


class _Reader:
    """One upstream answer's body turned into client chunks, piece by piece (no I/O).

    `feed` records what it finds in the ledger and returns the client chunks; it
    never raises: a failure is kept in `failure`, and `over` says the answer must
    not be read further (a failure, [DONE], or a stop string matched). The task
    (`MigratingProxy._attempt`) and the fast lane (`sink`) feed it in turn, in order.
    """

    __slots__ = ("_decoder", "_idle_events", "_kv", "_last_token", "_ledger", "_name", "_now",
                 "_stall", "_unparsed", "done", "failure")

    def __init__(self, name: str, ledger: StreamLedger, stall_s: float,
                 now: Callable[[], float], kv: _KvShare) -> None:
        self._name = name
        self._ledger = ledger
        self._kv = kv
        self._stall = stall_s
        self._now = now
        self._decoder = SseDecoder()
        self._last_token = now()
        self._idle_events = 0
        self._unparsed = 0  # bytes since the last complete event
        self.done = False  # [DONE] seen
        self.failure: Exception | None = None

    @property
    def over(self) -> bool:
        return self.done or self.failure is not None or self._ledger.stopped

    def feed(self, piece: bytes) -> list[dict[str, Any]]:
        """The client chunks of `piece` (several events of one read go out as one write)."""
        ledger = self._ledger
        batch: list[dict[str, Any]] = []
        events = self._decoder.feed(piece)
        start = ledger.generated_count
        if not events:
            self._unparsed += len(piece)
            if self._unparsed > _MAX_EVENT_BYTES:
                self.failure = UpstreamFailure(
                    f"{self._name}: {self._unparsed:,} bytes without a complete event")
            elif self._now() - self._last_token > self._stall:
                self.failure = UpstreamFailure(f"{self._name}: no token for {self._stall:g} s")
            return batch
        self._unparsed = 0
        for event in events:
            if event.is_done:
                self.done = True
                break
            before = ledger.generated_count
            try:
                chunk = ledger.observe(_loads(event.data))
            except (MalformedChunk, ValueError) as exc:
                self.failure = exc
                break
            if ledger.generated_count > before or ledger.finished:
                self._last_token = self._now()
                self._idle_events = 0
            else:
                self._idle_events += 1
                if self._idle_events > _MAX_EVENTS_WITHOUT_TOKEN \
                        or self._now() - self._last_token > self._stall:
                    self.failure = UpstreamFailure(
                        f"{self._name}: events but no token for {self._stall:g} s")
                    break
            if chunk is not None:
                batch.append(chunk)
            if ledger.stopped:
                break
        if ledger.generated_count != start:
            self._kv.grow(ledger.generated_count - start)
        return batch

    def sink(self, resp: UpstreamResponse, pusher: Pusher) -> Callable[[bytes], bool]:
        """`resp.sink` for the fast lane: each piece parsed and written to the client at once.

        It refuses pieces while the client cannot take them (they wait for the task,
        which writes them and waits for the client), and ends itself on the piece
        that makes the reader `over` (the task then raises or finishes).
        """

        def take(piece: bytes) -> bool:
            if not pusher.writable:
                return False
            try:
                batch = self.feed(piece)
                if batch:
                    pusher.write(_sse_batch(batch))
            except Exception as exc:  # a bug must not escape into the socket's callback
                self.failure = exc
            if self.over:
                resp.end_sink()
            return True

        return take


class MigratingProxy:
    """State and behaviour of one proxy process (routes are thin wrappers)."""

    def __init__(self, inventory: Inventory, config: ProxyConfig, *,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.inventory = inventory
        self.config = config
        self.clock = clock
        self.router = Router(
            (WorkerSlot(name=w.name, url=w.url, group=inventory.group_of(w), model=w.model)
             for w in inventory.workers),
            clock=clock, breaker_threshold=config.breaker_threshold,
            recovery_s=config.breaker_recovery_s,
        )
        default = Thresholds(
            active_decode_blocks_threshold=config.busy.active_decode_blocks_threshold,
            active_prefill_tokens_threshold=config.busy.active_prefill_tokens_threshold,
        )
        self.thresholds: dict[str, Thresholds] = {w.model: default for w in inventory.workers}
        self.loads: dict[str, WorkerLoad | None] = {w.name: None for w in inventory.workers}
        self._prompt_tokens_seen = 0
        self._prompts_seen = 0
        self._http: Client | None = None
        self._kv_client: httpx.AsyncClient | None = None  # one-shot KV exports
        self.calibration = _load_calibration(inventory, config)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._queued = 0
        self._in_flight = 0  # requests in `generate`
        self._retries_in_flight = 0  # their retries before a first token (the retry budget)
        self._workers = {w.name: w for w in inventory.workers}
        self.capabilities: CapabilityCache | None = None
        self._learning: set[str] = set()  # workers whose capability probe is running
        from dynamo_ftctl import metrics

        self.metrics = metrics

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the upstream connection pools and start the scrape loop."""
        from dynamo_ftctl.capabilities import CapabilityCache, fetch_through

        self._http = Client(user_agent="ftctl-proxy")
        if self.config.health_url and not token_from_env(self.config.health_token_env):
            log.warning("$%s is not set: worker failures are not reported to the canary "
                        "daemon at %s", self.config.health_token_env, self.config.health_url)
        self.capabilities = CapabilityCache(fetch=fetch_through(self._http), clock=self.clock)
        self._spawn(self._scrape_forever())

    async def stop(self) -> None:
        """Stop background work and close the pools."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._kv_client is not None:
            await self._kv_client.aclose()
            self._kv_client = None
        if self.capabilities is not None:
            await self.capabilities.aclose()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def http(self) -> Client:
        """The upstream HTTP client (keep-alive pools per worker)."""
        if self._http is None:
            msg = "proxy not started"
            raise RuntimeError(msg)
        return self._http

    # ------------------------------------------------------------------ scraping

    async def _scrape_forever(self) -> None:
        while True:
            await self.scrape_once()
            await self.clock.asleep(self.config.scrape_interval_s)

    async def scrape_once(self) -> None:
        """Scrape every worker's /metrics (and /v1/models until known) and the daemon.

        Then every worker's busy flag is worked out again: without it, /health and
        the gauges kept the flag of the last admission, however long ago that was.
        """
        jobs = [self._scrape_worker(slot) for slot in self.router.slots.values()]
        if self.config.health_url:
            jobs.append(self._poll_daemon(self.config.health_url))
        await asyncio.gather(*jobs, return_exceptions=True)
        self.refresh_busy()
        self.refresh_gauges()

    async def _get(self, url: str) -> bytes:
        timeout_s = max(0.5, min(self.config.scrape_interval_s, 5.0))
        status, body = await self.http.fetch("GET", url, timeout_s=timeout_s)
        if status != 200:
            msg = f"HTTP {status}"
            raise UpstreamFailure(msg)
        return body

    async def _scrape_worker(self, slot: WorkerSlot) -> None:
        # What a worker's probe found missing is not asked for every scrape (a server
        # without /metrics, or whose /v1/models gives no max_model_len, answered every
        # 0.1 s with a 404 or a 500 that dropped the connection).
        caps = self.capabilities.get(slot.name) if self.capabilities is not None else None
        if caps is not None and caps.metrics is False:
            self._watch_capabilities(slot, b"")
            return
        if slot.max_model_len is None and (caps is None or caps.max_model_len is not None):
            with contextlib.suppress(Exception):
                doc = json.loads(await self._get(f"{slot.url}/v1/models"))
                for entry in doc.get("data", ()):
                    length = entry.get("max_model_len")
                    if entry.get("id") == slot.model and isinstance(length, int):
                        slot.max_model_len = length
        try:
            page = await self._get(f"{slot.url}/metrics")
            slot.kv_blocks_at_scrape = slot.kv_blocks
            self.loads[slot.name] = parse_worker_load(page.decode("utf-8", "replace"))
        except Exception:  # an unscrapable worker has no load figure; health decides
            self.loads[slot.name] = None
            page = b""
        self._watch_capabilities(slot, page)

    # ------------------------------------------------------------------ capabilities

    def _watch_capabilities(self, slot: WorkerSlot, metrics_page: bytes) -> None:
        """Probe a worker whose capabilities are unknown, new or restarted (see `learn`)."""
        from dynamo_ftctl.capabilities import start_time_from_metrics

        cache = self.capabilities
        if cache is None:
            return
        started = start_time_from_metrics(metrics_page) if metrics_page else None
        if started is not None and cache.note_start_time(slot.name, started):
            log.info("%s restarted: probing its capabilities again", slot.name)
            slot.token_ids = dict.fromkeys(slot.token_ids)
        if cache.get(slot.name) is None and slot.name not in self._learning:
            self._learning.add(slot.name)
            self._spawn(self.learn(slot))

    async def learn(self, slot: WorkerSlot) -> None:
        """Probe `slot`'s worker (docs/compatibility.md) and apply what it supports.

        Until a probe answers, requests ask for token ids; a worker that refuses the
        field is known from its first refusal on (`_refused_ids`).
        """
        assert self.capabilities is not None
        try:
            caps = await self.capabilities.probe(self._workers[slot.name])
        finally:
            self._learning.discard(slot.name)
        for endpoint, known in (("completions", caps.token_ids), ("chat", caps.chat_token_ids)):
            if known is not None:
                slot.token_ids[endpoint] = known
        if caps.max_model_len is not None and slot.max_model_len is None:
            slot.max_model_len = caps.max_model_len

    def _refused_ids(self, slot: WorkerSlot, endpoint: str, exc: UpstreamRefused) -> bool:
        """True when `slot` refused the `return_token_ids` field it was sent (now known)."""
        if exc.status not in (400, 422) or not slot.sends_token_ids(endpoint) \
                or b"return_token_ids" not in exc.body:
            return False
        log.warning("%s refuses return_token_ids on /v1/%s: continuing without ids (text)",
                    slot.name, "chat/completions" if endpoint == "chat" else "completions")
        slot.token_ids[endpoint] = False
        return True

    async def _poll_daemon(self, base: str) -> None:
        try:
            weights = parse_daemon_weights(json.loads(await self._get(f"{base}/workers")))
        except Exception:  # daemon away: fall back on our own breaker
            weights = {}
        self.router.apply_daemon_weights(weights)

    def _report_failure(self, slot: WorkerSlot, reason: str) -> None:
        base = self.config.health_url
        # Read per report: a token rotated in the environment of a test or embedder counts.
        token = token_from_env(self.config.health_token_env)
        if not base or not token:
            return  # the daemon refuses unauthenticated reports (start() said so once)

        async def post() -> None:
            body = {"worker": slot.name, "ok": False, "reason": reason, "source": "proxy"}
            with contextlib.suppress(Exception):
                await self.http.fetch("POST", f"{base}/report", _dumps(body),
                                      {"Content-Type": "application/json",
                                       **bearer_headers(token)}, timeout_s=2.0)

        self._spawn(post())

    # ------------------------------------------------------------------ admission

    def thresholds_for(self, model: str) -> Thresholds:
        return self.thresholds.get(model) or next(iter(self.thresholds.values()))

    def _mean_prompt_tokens(self) -> float:
        return self._prompt_tokens_seen / self._prompts_seen if self._prompts_seen else 0.0

    def _busy(self, slot: WorkerSlot, mean_prompt_tokens: float) -> bool:
        slot.busy = is_busy(
            self.loads.get(slot.name), self.thresholds_for(slot.model),
            pending_prefill_tokens=slot.pending_prefill_tokens,
            mean_prompt_tokens=mean_prompt_tokens, kv_blocks=slot.kv_blocks,
            kv_blocks_at_scrape=slot.kv_blocks_at_scrape,
        )
        return slot.busy

    def _refresh_busy(self, model: str | None) -> list[bool]:
        mean = self._mean_prompt_tokens()
        return [self._busy(slot, mean) for slot in self.router.routable(model)]

    def refresh_busy(self) -> None:
        """Work out every worker's busy flag from what is known now."""
        mean = self._mean_prompt_tokens()
        for slot in self.router.slots.values():
            self._busy(slot, mean)

    def level(self) -> int:
        return degradation_level(self.router.healthy_capacity())

    def refresh_gauges(self) -> None:
        """Set the gauges (each scrape of /metrics and of the workers does).

        The hot path only counts (`_queued`, the breakers): a gauge's `set` takes
        a lock, and three per request were ~4% of a request's CPU.
        """
        self.metrics.DEGRADATION_LEVEL.set(self.level())
        self.metrics.QUEUED_REQUESTS.set(self._queued)
        for slot in self.router.slots.values():
            self.metrics.CIRCUIT_BREAKER_STATE.labels(slot.name).set(
                self.router.breaker_gauge(slot),
            )
            self.metrics.WORKER_BUSY.labels(slot.name).set(int(slot.busy))

    def admit(self, model: str | None, priority_header: str | None) -> None:
        """Raise `ProxyError` (503/529 + Retry-After) when the request must be refused."""
        priority = parse_priority(priority_header)
        level = self.level()
        decision = decide(priority, level, self._refresh_busy(model),
                          premium_when_busy=self.config.premium_when_busy == "admit")
        if decision.admitted:
            return
        self.metrics.TASKS_REJECTED.labels(decision.reason, priority).inc()
        status = self.config.reject_status
        if decision.reason == "all_workers_busy":
            body = dict(BUSY_BODY)
        elif decision.reason == "no_healthy_worker":
            body = {**BUSY_BODY, "message": "Service temporarily unavailable: "
                    "no healthy worker, please retry later"}
        else:
            body = {**BUSY_BODY, "message": f"Service temporarily unavailable: {priority} "
                    f"requests are shed at degradation level {level}, please retry later"}
        body["code"] = status
        raise ProxyError(status, body, {"Retry-After": str(self.config.retry_after_s)})

    # ------------------------------------------------------------------ one attempt

    async def _attempt(self, slot: WorkerSlot, url: str, body: bytes, ledger: StreamLedger,
                       headers: dict[str, str], *,
                       lane: Lane | None = None) -> AsyncIterator[list[dict[str, Any]]]:
        """Stream one upstream request; yield batches of client chunks; raise on any failure.

        Once a batch has gone out and the client's stream has a `Pusher` (`lane`), the
        upstream's pieces go to `_Reader.sink` in its socket callback and straight to
        the client; this generator wakes only when the sink ends (a [DONE], a stop
        string, a failure) or refuses a piece (the client's buffer is full).
        Leaving early (an exception, `aclose()`, the client's cancellation) closes the
        upstream connection unless its answer was read to the end.
        """
        stall = self.config.stall_timeout_s
        resp: AnyResponse | None = None
        # The context the worker holds for this attempt: the prompt, and for a
        # continuation the tokens generated before (in its prompt or its KV import).
        load = self.loads.get(slot.name)
        kv = _KvShare(slot, load.block_size if load is not None and load.block_size
                      else _DEFAULT_BLOCK_SIZE)
        kv.grow(ledger.generated_count + (
            len(ledger.prompt_ids) if ledger.prompt_ids is not None
            else _estimate_prompt_tokens(ledger.endpoint, ledger.body)))
        try:
            resp = await self.http.request("POST", url, body, headers,
                                           connect_timeout_s=self.config.connect_timeout_s,
                                           head_timeout_s=stall)
            status = resp.status or 0
            if status >= 500 or status in _UNAVAILABLE_STATUSES:
                msg = f"HTTP {status} from {slot.name}"
                raise UpstreamFailure(msg, None if status in _UNAVAILABLE_STATUSES
                                      else f"HTTP {status}")
            if status >= 400:
                raise UpstreamRefused(status, await resp.read(timeout_s=stall),
                                      resp.header("content-type") or "application/json")
            content_type = resp.header("content-type") or ""
            if status != 200 or not content_type.startswith("text/event-stream"):
                msg = f"{slot.name} answered HTTP {status} {content_type or 'untyped'}, " \
                      "not an event stream"
                raise UpstreamFailure(msg)
            reader = _Reader(slot.name, ledger, stall, self.clock.now, kv)
            token_out = False  # `generate` has seen a batch with this attempt's first token
            while piece := await resp.next_chunk(stall):
                batch = reader.feed(piece)
                if batch:
                    if ledger.upstream_ttft_s is None:
                        ledger.upstream_ttft_s = resp.body_wait_s
                    token_out = ledger.attempt_tokens > 0
                    yield batch  # what the ledger recorded reaches the client, always
                if reader.over:
                    break
                # Not before `generate` has seen this attempt's first token: it counts a
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
                msg = f"{slot.name}: stream ended without a finish reason"
                raise UpstreamFailure(msg)
        except (UpstreamFailure, UpstreamRefused):
            raise
        except ErrorEvent as exc:
            code = exc.status
            if code is not None and 400 <= code < 500 and code not in _UNAVAILABLE_STATUSES:
                raise UpstreamRefused(code, _dumps(exc.doc), "application/json") from None
            msg = f"{slot.name}: {exc}"
            raise UpstreamFailure(msg, None if code in _UNAVAILABLE_STATUSES
                                  else f"error event {code or ''}".rstrip()) from None
        except MalformedChunk as exc:
            msg = f"{slot.name}: {exc}"
            raise UpstreamFailure(msg) from None
        except (OSError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            # OSError: http1.HttpError (refused, reset, cut, not HTTP, too large).
            kind = type(exc).__name__
            msg = f"{slot.name}: {kind}: {exc}".rstrip(": ")
            # Lost once the request went out: perhaps a worker that crashes on it. A
            # connection never made, a timeout or garbage says nothing of the request.
            lost = isinstance(exc, ConnectError | ConnectionBroken) \
                and not isinstance(exc, Unreachable)
            raise UpstreamFailure(msg, "connection lost" if lost else None,
                                  gone=isinstance(exc, ConnectError | ConnectionBroken)) from None
        finally:
            kv.release()
            if resp is not None:
                resp.close()

    # ------------------------------------------------------------------ migration

    async def generate(self, ledger: StreamLedger,
                       lane: Lane | None = None) -> AsyncGenerator[list[dict[str, Any]], None]:
        """Batches of client chunks of one request, across as many workers as it takes.

        Raises `ProxyError` when nothing was produced, `StreamAborted` after. With a
        `lane`, an attempt's chunks after its first batch may go straight to the
        client instead (see `_attempt`).
        """
        model = ledger.body.get("model") if isinstance(ledger.body.get("model"), str) else None
        failed_workers: set[str] = set()
        failed_groups: set[str] = set()
        body = ledger.first_request()
        prompt_estimate = _estimate_prompt_tokens(ledger.endpoint, ledger.body)
        yielded = False
        failed_at: float | None = None
        source_group = ""
        method = ""
        kv_payload = b""  # a KV export to import on the next worker (method "kv")
        suspect: _Suspect | None = None  # a failure charged once another worker tells whose
        retrying = False  # this attempt holds a place in the retry budget
        budgeted = False  # the next attempt is a retry the budget caps
        self._queued += 1
        self._in_flight += 1
        queued = True
        try:
            while True:
                slot = self.router.pick(
                    model=model, exclude_workers=failed_workers, exclude_groups=failed_groups,
                    avoid_busy=not failed_workers, last_resort=bool(failed_workers),
                )
                if slot is None:
                    what = "no other healthy worker to continue on" if failed_workers \
                        else "no worker available"
                    if not yielded:
                        raise ProxyError(502 if failed_workers else 503, _openai_error(
                            f"Service unavailable: {what}", "service_unavailable",
                            502 if failed_workers else 503))
                    raise StreamAborted(f"stream broken after {ledger.generated_count} "
                                        f"tokens and {what}")
                if slot.max_model_len is not None:
                    ledger.max_model_len = min(ledger.max_model_len or slot.max_model_len,
                                               slot.max_model_len)
                ledger.start_attempt(slot.name)
                self.router.start(slot, prompt_estimate)
                pending = prompt_estimate
                if method == "retry" and budgeted:
                    retrying = True
                    self._retries_in_flight += 1
                if method == "kv":
                    url, data, headers = self._kv_import(slot, kv_payload, ledger)
                else:
                    sent = body if slot.sends_token_ids(ledger.upstream_endpoint) \
                        else _without_ids(body)
                    url, data = f"{slot.url}{ledger.upstream_path}", _dumps(sent)
                    headers = {"Content-Type": "application/json",
                               "X-Request-Id": ledger.trace_id}
                try:
                    async for batch in self._attempt(slot, url, data, ledger, headers,
                                                     lane=lane):
                        if pending:
                            self.router.first_token(slot, pending)
                            pending = 0
                            if queued:
                                queued = False
                                self._queued -= 1
                            if failed_at is not None:
                                # Counted once the stream goes on (a KV import that
                                # failed and fell back to re-prefill counts as that).
                                gap = self.clock.now() - failed_at
                                self.metrics.MIGRATION_TOTAL.labels(
                                    source_group, slot.group, method).inc()
                                self.metrics.MIGRATION_DURATION.observe(gap)
                                failed_at = None
                        if ledger.attempt_tokens:
                            if suspect is not None:
                                # The request runs here: the worker it failed on is at fault.
                                self._charge(suspect.slot, suspect.reason)
                                suspect = None
                            if retrying:
                                retrying = False
                                self._retries_in_flight -= 1
                        yielded = True
                        yield batch
                    self.router.record_success(slot)
                    self._note_prompt(ledger)
                    return
                except UpstreamRefused as exc:
                    self.router.record_success(slot)  # it answered: a 4xx is not its failure
                    if _import_failed(method, ledger, slot, exc):
                        method, kv_payload = "reprefill", b""
                        continue
                    if method != "kv" and self._refused_ids(slot, ledger.upstream_endpoint, exc):
                        continue  # the same body again, without the field
                    if suspect is not None:
                        # Refused here, it failed there: the request's fault, not that worker's.
                        log.info("%s not charged: %s refused the request it failed on "
                                 "(HTTP %d)", suspect.slot.name, slot.name, exc.status)
                        self.router.record_neutral(suspect.slot)
                        suspect = None
                    if not yielded and ledger.generated_count == 0:
                        raise ProxyError(exc.status, self._refusal_body(exc)) from None
                    message = exc.body.decode("utf-8", "replace")[:200]
                    what = "continuation" if ledger.migrations else "request"
                    raise StreamAborted(f"{what} refused by {slot.name}: "
                                        f"HTTP {exc.status} {message}") from None
                except UpstreamFailure as exc:
                    if _import_failed(method, ledger, slot, exc):
                        method, kv_payload = "reprefill", b""
                        continue
                    reason = str(exc)
                    log.warning("worker failed: %s (after %d tokens)", reason,
                                ledger.generated_count)
                    # Only a failure before the attempt's first token may be the request's:
                    # a stream cut after it (a killed worker) is the worker's.
                    way = exc.way if not ledger.attempt_tokens else None
                    if way is not None and suspect is not None and suspect.way == way:
                        first, suspect = suspect.slot, None
                        raise self._query_of_death(ledger, first, slot, way, yielded) from None
                    if suspect is not None:  # failed another way here: both workers' fault
                        self._charge(suspect.slot, suspect.reason)
                        suspect = None
                    if way is None:
                        self._charge(slot, reason)
                    else:
                        suspect = _Suspect(slot, reason, way)
                    failed_workers.add(slot.name)
                    failed_groups.add(slot.group)
                    failed_at = self.clock.now()
                    source_group = slot.group
                    body, method = self._next_body(ledger, reason)
                    if not body:
                        yield [ledger.finish_chunk("length")]
                        return
                    # A worker that went away did no work a retry repeats: the load
                    # moves (issue 22's drill: a SIGKILLed vLLM's queued requests got
                    # 503 past the budget). Answered failures and timeouts are capped.
                    budgeted = method == "retry" and not exc.gone
                    if budgeted and not self._retry_allowed():
                        raise self._retry_refused(reason, yielded) from None
                    # Dynamo's mirror counts the decision to go on (its frontend counts
                    # before re-issuing); ftctl_migrations_total counts the stream going on.
                    self.metrics.DYNAMO_MIGRATION_TOTAL.labels(
                        model or "", "new_request" if method == "retry"
                        else "ongoing_request").inc()
                    export_s = self._kv_export_budget(ledger) if method == "reprefill" else 0
                    if export_s:
                        kv_payload = await self._export_kv(slot, ledger, export_s)
                        if kv_payload:
                            method = "kv"
                finally:
                    self.router.finish(slot, pending)
                    if retrying:
                        retrying = False
                        self._retries_in_flight -= 1
        finally:
            if queued:
                self._queued -= 1
            self._in_flight -= 1
            if suspect is not None:  # no other worker told (none left, the client left)
                self._charge(suspect.slot, suspect.reason)

    def _charge(self, slot: WorkerSlot, reason: str) -> None:
        """Count a failure against `slot`: its breaker, the canary daemon, its capabilities."""
        self.router.record_failure(slot)
        self._report_failure(slot, reason)
        if self.capabilities is not None:
            self.capabilities.invalidate(slot.name)  # probed again once it answers

    def _query_of_death(self, ledger: StreamLedger, first: WorkerSlot, second: WorkerSlot,
                        way: str, yielded: bool) -> Exception:
        """The error that ends a request that failed `way` on two workers (neither charged).

        The request, not the fleet, is the suspect: tried on every worker, it would
        open every breaker (issue 22: three such requests took a two-worker cluster
        down for 60 s). A half-open breaker whose trial it was may try again.
        """
        self.router.record_neutral(first)
        self.router.record_neutral(second)
        self.metrics.QUERY_OF_DEATH.inc()
        log.warning("query of death: request %s failed the same way (%s) on %s and %s; "
                    "not tried on more workers, neither charged",
                    ledger.trace_id, way, first.name, second.name)
        message = (f"the request failed the same way ({way}) on two workers "
                   f"({first.name}, {second.name}); it is not tried on more workers, "
                   "as it may be what breaks them")
        if yielded:
            return StreamAborted(message, "query_of_death")
        return ProxyError(502, _openai_error(message, "query_of_death", 502))

    def _retry_allowed(self) -> bool:
        """Whether one more retry fits the retry budget (Envoy's `retry_budget`)."""
        budget = self.config.retry_budget
        allowed = max(budget.min_retry_concurrency,
                      budget.budget_percent / 100 * self._in_flight)
        return self._retries_in_flight < allowed

    def _retry_refused(self, reason: str, yielded: bool) -> Exception:
        """The error that ends a failed request the retry budget has no room for."""
        self.metrics.RETRY_BUDGET_EXHAUSTED.inc()
        log.debug("retry budget spent (%d retries of %d requests in flight): %s",
                  self._retries_in_flight, self._in_flight, reason)
        message = (f"{reason}; not retried: the proxy's retry budget is spent "
                   f"({self._retries_in_flight} retries in flight), please retry later")
        if yielded:
            return StreamAborted(message, "retry_budget_exhausted")
        return ProxyError(503, _openai_error(message, "retry_budget_exhausted", 503),
                          {"Retry-After": str(self.config.retry_after_s)})

    def _next_body(self, ledger: StreamLedger, reason: str) -> tuple[dict[str, Any], str]:
        """The next upstream body and the migration method; ({}, "") ends with "length"."""
        if ledger.generated_count == 0:
            if ledger.migrations >= ledger.migration_limit:
                raise self._give_up(ledger, f"{reason}; migration limit "
                                    f"({ledger.migration_limit}) reached")
            ledger.note_migration()
            return ledger.retry_request(), "retry"
        try:
            body = ledger.continuation_request()
        except NotContinuable as exc:
            if exc.finish_reason is not None:
                return {}, ""
            raise self._give_up(ledger, f"{reason}; {exc}") from None
        ledger.note_migration()
        return body, "reprefill" if ledger.exact else "text"

    # ------------------------------------------------------------------ KV transfer

    def _kv_export_budget(self, ledger: StreamLedger) -> float:
        """Seconds to give a KV export when the calibrated model prefers a transfer, else 0.

        Completions with token ids only: a KV import streams completion chunks, and
        its context must be exactly the ledger's prompt + generated ids. The budget is
        twice the modelled re-prefill (at least 0.5 s, at most the stall timeout): an
        export slower than that has lost to re-prefill already (a hung worker).
        """
        if self.calibration is None or ledger.endpoint != "completions" \
                or not ledger.ids_mode or ledger.prompt_ids is None:
            return 0.0
        from dynamo_ftctl.migrate.transfer import RequestState, choose_method

        context = (*ledger.prompt_ids, *ledger.generated_ids)
        state = RequestState(
            request_id=ledger.trace_id, model=self.calibration.model, token_ids=context,
            prompt_len=len(ledger.prompt_ids), num_cached=len(context), sampling={},
            kv_bytes_per_token=self.calibration.kv_bytes_per_token, payload_bytes=0,
        )
        plan = choose_method(state, self.calibration)
        if plan.decision != "kv":
            return 0.0
        return min(max(2 * plan.reprefill_s, 0.5), self.config.stall_timeout_s)

    async def _export_kv(self, slot: WorkerSlot, ledger: StreamLedger, budget_s: float) -> bytes:
        """Export (and stop) the request on the failed worker; b"" when it cannot be moved."""
        import httpx

        from dynamo_ftctl.errors import FtctlError
        from dynamo_ftctl.migrate.transfer import endpoint_for, export_request

        if self._kv_client is None:
            self._kv_client = httpx.AsyncClient(timeout=httpx.Timeout(
                self.config.stall_timeout_s, connect=self.config.connect_timeout_s))
        try:
            async with asyncio.timeout(budget_s):
                state, payload, _ = await export_request(
                    self._kv_client, endpoint_for(self.inventory, slot.name), ledger.trace_id,
                    abort=True, clock=self.clock,
                )
        except (FtctlError, ValueError, TimeoutError) as exc:  # gone, hung, no KV, garbage
            log.info("no KV export from %s (%s): re-prefill", slot.name, exc)
            return b""
        context = [*(ledger.prompt_ids or ()), *ledger.generated_ids]
        if list(state.token_ids) != context:
            # It decoded tokens the client never saw (their text is lost): re-prefill.
            log.info("KV export from %s holds %d tokens, the client saw %d: re-prefill",
                     slot.name, len(state.token_ids), len(context))
            return b""
        return payload

    def _kv_import(self, slot: WorkerSlot, payload: bytes,
                   ledger: StreamLedger) -> tuple[str, bytes, dict[str, str]]:
        """URL, body and headers of the import that continues the request on `slot`."""
        from dynamo_ftctl.migrate.transfer import endpoint_for

        target = endpoint_for(self.inventory, slot.name)
        headers = {**target.admin_headers(), "X-Request-Id": ledger.trace_id,
                   "Content-Type": "application/octet-stream"}
        return f"{target.admin_url}/admin/kv/import", payload, headers

    @staticmethod
    def _give_up(ledger: StreamLedger, message: str) -> Exception:
        if ledger.generated_count == 0 and not ledger.migrations:
            return ProxyError(502, _openai_error(message, "worker_failed", 502))
        return StreamAborted(message)

    @staticmethod
    def _refusal_body(exc: UpstreamRefused) -> dict[str, Any]:
        try:
            doc = json.loads(exc.body)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            return doc
        return _openai_error(exc.body.decode("utf-8", "replace")[:500], "invalid_request_error",
                             exc.status)

    def _note_prompt(self, ledger: StreamLedger) -> None:
        if ledger.prompt_ids is not None:
            self._prompt_tokens_seen += len(ledger.prompt_ids)
            self._prompts_seen += 1

    # ------------------------------------------------------------------ HTTP handlers

    async def handle_generation(
        self, endpoint: Endpoint, raw_body: bytes, priority: str | None,
        request_id: str | None = None,
    ) -> Reply | Stream | Collected:
        """POST /v1/completions and /v1/chat/completions (`priority`: the tier header).

        `request_id` is the client's `X-Request-Id`: every worker gets it, and so does
        the client back; without one the proxy makes a UUID (some servers refuse other
        ids with 400).

        A `Stream` has its first batch in hand (the worker answered): the client's
        headers can name the serving worker. A `Collected` answer is built by
        awaiting its `build()` while the client waits.
        """
        try:
            raw = parse_request_json(raw_body)
            body = prepare_request(endpoint, raw)
        except (ValueError, RequestRejected) as exc:
            param = exc.param if isinstance(exc, RequestRejected) else None
            return _reply(400, error_body(f"invalid request: {exc}",
                                          type="invalid_request_error", param=param, code=400))
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not self.router.serves(model)):
            return _reply(404, _openai_error(f"The model {model!r} does not exist.",
                                             "NotFoundError", 404))
        try:
            self.admit(model, priority)
        except ProxyError as exc:
            return _reply(exc.status, exc.body, exc.headers)
        ledger = StreamLedger(endpoint=endpoint, body=body,
                              migration_limit=self.config.migration_limit,
                              trace_id=request_id or "")
        lane = Lane() if ledger.client_streams else None
        chunks = self.generate(ledger, lane)
        if lane is None:

            async def collect() -> Reply:
                try:
                    async for _ in chunks:
                        pass
                except ProxyError as exc:
                    return _reply(exc.status, exc.body, exc.headers)
                except StreamAborted as exc:
                    return _reply(502, _openai_error(str(exc), exc.kind, 502))
                finally:
                    await chunks.aclose()
                return Reply(200, _dumps(ledger.response()), headers=self._answer_headers(ledger))

            return Collected(collect)
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except ProxyError as exc:
            return _reply(exc.status, exc.body, exc.headers)
        except StreamAborted as exc:
            return _reply(502, _openai_error(str(exc), exc.kind, 502))
        return Stream(self._sse_body(ledger, first, chunks), headers=self._answer_headers(ledger),
                      on_push=lane.bind)

    @staticmethod
    def _answer_headers(ledger: StreamLedger) -> dict[str, str]:
        headers = {"Cache-Control": "no-cache", "X-Request-Id": ledger.trace_id,
                   WORKER_HEADER: ",".join(ledger.workers)}
        if ledger.migrations:
            headers[MIGRATED_HEADER] = str(ledger.migrations)
        if not ledger.exact:
            headers[CONTINUATION_HEADER] = "text"
        if ledger.upstream_ttft_s is not None:
            ms = ledger.upstream_ttft_s * 1e3
            headers[TIMING_HEADER] = f'upstream;desc="first token";dur={ms:.3f}'
        return headers

    async def _sse_body(self, ledger: StreamLedger, first: list[dict[str, Any]] | None,
                        chunks: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield _sse_batch(first)
            try:
                async for batch in chunks:
                    yield _sse_batch(batch)
            except (StreamAborted, ProxyError) as exc:
                message, kind = (str(exc), exc.kind) if isinstance(exc, StreamAborted) \
                    else (str(exc.body), "worker_failed")
                yield _sse(_openai_error(message, kind, 502))
                yield _SSE_DONE
                return
            tail = _sse(ledger.usage_chunk()) if ledger.client_wants_usage else b""
            if ledger.migrations:
                # Headers left before the stream broke: say it in an SSE comment.
                tail += f": {MIGRATED_HEADER}: {ledger.migrations}\n\n".encode()
            yield tail + _SSE_DONE
        finally:
            # The client went away (or we are done): close the upstream stream now.
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def handle_models(self) -> Response:
        data = []
        for model in dict.fromkeys(s.model for s in self.router.slots.values()):
            lens = [s.max_model_len for s in self.router.slots.values()
                    if s.model == model and s.max_model_len is not None]
            entry: dict[str, Any] = {"id": model, "object": "model", "owned_by": "ftctl",
                                     "created": 0}
            if lens:
                entry["max_model_len"] = min(lens)
            data.append(entry)
        return _json(200, {"object": "list", "data": data})

    def health(self) -> dict[str, Any]:
        """The proxy's own health: always fast, no upstream call."""
        self.refresh_busy()
        return {
            "status": "ok",
            "degradation_level": self.level(),
            "workers": {
                s.name: {"weight": round(self.router.weight(s), 3), "breaker": s.breaker,
                         "busy": s.busy, "outstanding": s.outstanding}
                for s in self.router.slots.values()
            },
        }

    def busy_threshold_doc(self, model: str) -> dict[str, Any]:
        t = self.thresholds_for(model)
        return {"model": model,
                "active_decode_blocks_threshold": t.active_decode_blocks_threshold,
                "active_prefill_tokens_threshold": t.active_prefill_tokens_threshold}

    async def handle_busy_threshold(self, request: Request) -> Response:
        """GET (anyone) or POST (admin token) the busy thresholds of a model."""
        if request.method == "GET":
            model = request.query_params.get("model")
            if model is not None:
                if model not in self.thresholds:
                    return _json(404, _openai_error(f"unknown model {model!r}", "not_found", 404))
                return _json(200, self.busy_threshold_doc(model))
            return _json(200, {"thresholds": [self.busy_threshold_doc(m)
                                              for m in self.thresholds]})
        denied = self._check_admin(request.headers.get("authorization"))
        if denied is not None:
            return denied
        try:
            doc = parse_request_json(await request.body())
            if not isinstance(doc, dict):
                msg = "expected a JSON object"
                raise ValueError(msg)
            model = doc.get("model", next(iter(self.thresholds)))
            if model not in self.thresholds:
                return _json(404, _openai_error(f"unknown model {model!r}", "not_found", 404))
            current = self.thresholds[model]
            unknown = set(doc) - {"model", "active_decode_blocks_threshold",
                                  "active_prefill_tokens_threshold"}
            if unknown:
                msg = f"unknown keys {sorted(unknown)}"
                raise ValueError(msg)
            self.thresholds[model] = Thresholds(
                active_decode_blocks_threshold=doc.get(
                    "active_decode_blocks_threshold", current.active_decode_blocks_threshold),
                active_prefill_tokens_threshold=doc.get(
                    "active_prefill_tokens_threshold", current.active_prefill_tokens_threshold),
            )
        except ValueError as exc:
            return _json(400, _openai_error(str(exc), "invalid_request_error", 400))
        log.info("busy thresholds of %s now %s", model, self.thresholds[model])
        return _json(200, self.busy_threshold_doc(model))

    def _check_admin(self, authorization: str | None) -> Response | None:
        env = self.config.admin_token_env
        denied = check_bearer(authorization, token_from_env(env),
                              unset=f"admin API disabled: ${env} is not set")
        if denied is None:
            return None
        kind = "forbidden" if denied.status == 403 else "unauthorized"
        return _json(denied.status, _openai_error(denied.message, kind, denied.status),
                     denied.headers)


def _import_failed(method: str, ledger: StreamLedger, slot: WorkerSlot,
                   exc: Exception) -> bool:
    """A KV import that failed before its first token (the caller re-prefills)."""
    if method != "kv" or ledger.attempt_tokens:
        return False
    log.warning("KV import on %s failed (%s); re-prefilling", slot.name, exc)
    return True


def _load_calibration(inventory: Inventory, config: ProxyConfig) -> Calibration | None:
    """The proxy's calibration (its path relative to the inventory), or None."""
    if config.calibration is None:
        return None
    from dynamo_ftctl.migrate.calibrate import load_calibration

    return load_calibration(inventory.resolve(config.calibration))


class cancel_on_disconnect:  # noqa: N801 (named like the function it replaced)
    """Cancel the current task when the client disconnects; the block then ends quietly.

    One watcher task per request: cheaper on the hot path than Starlette's anyio
    task group, and the cancellation reaches the upstream request at once
    (issue #9: a client disconnect cancels the upstream request). A class, not
    `contextlib.asynccontextmanager`: ~6% of a non-streamed request's CPU less.
    """

    __slots__ = ("_active", "_receive", "_task", "_watcher", "left")

    def __init__(self, receive: Any) -> None:
        self._receive = receive
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._active = True
        self.left = False  # the client has gone

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if self._active and self._task is not None:
            self.left = True
            self._task.cancel()

    async def __aenter__(self) -> cancel_on_disconnect:
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> bool:
        self._active = False
        if self._watcher is not None:
            self._watcher.cancel()
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError) \
                and self.left and self._task is not None:
            self._task.uncancel()  # the client left: a normal end for us
            return True
        return False


@dataclass(frozen=True, slots=True)
class Collected:
    """A non-streamed answer: `build()` runs the generation (cancelled if the client leaves)."""

    build: Callable[[], Awaitable[Reply]]


async def _send_reply(reply: Reply, send: Any) -> None:
    """A whole `Reply` as ASGI messages."""
    headers = [(b"content-type", reply.content_type.encode("latin-1")),
               (b"content-length", str(len(reply.body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in reply.headers.items()]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})


async def _send_stream(stream: Stream, receive: Any, send: Any) -> None:
    """A `Stream` as ASGI messages, cancelled when the client leaves."""
    headers = [(b"content-type", stream.content_type.encode("latin-1"))] + [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in stream.headers.items()
    ]
    try:
        async with cancel_on_disconnect(receive):
            await send({"type": "http.response.start", "status": stream.status,
                        "headers": headers})
            async for chunk in stream.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        aclose = getattr(stream.chunks, "aclose", None)
        if aclose is not None:
            await aclose()


async def _send_answer(answer: Reply | Stream | Collected, receive: Any, send: Any) -> None:
    """A generation answer over ASGI (the app served by any ASGI server, and the tests)."""
    if isinstance(answer, Collected):
        async with cancel_on_disconnect(receive):
            await _send_reply(await answer.build(), send)
    elif isinstance(answer, Reply):
        await _send_reply(answer, send)
    else:
        await _send_stream(answer, receive, send)


def _without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without `return_token_ids`, for a worker that refuses or ignores it."""
    return {k: v for k, v in body.items() if k != "return_token_ids"}


def _reply(status: int, doc: Any, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, _dumps(doc), headers=headers or {})


def _json(status: int, doc: Any, headers: Mapping[str, str] | None = None) -> Response:
    from starlette.responses import Response

    return Response(_dumps(doc), status_code=status, media_type="application/json",
                    headers=dict(headers or {}))


_GENERATION_ROUTES: dict[str, Endpoint] = {
    "/v1/completions": "completions", "/v1/chat/completions": "chat",
}
_PRIORITY_KEY = PRIORITY_HEADER.encode()
_REQUEST_ID_KEY = b"x-request-id"


class ProxyApp:
    """The proxy's ASGI app: generation requests straight to the proxy, the rest to Starlette.

    The hot path skips Starlette's middleware, router and `Request` (a quarter of
    the proxy's CPU per non-streamed request in py-spy); the other routes
    (/health, /metrics, /v1/models, /busy_threshold) and the lifespan keep it.
    `serve` does not run it under an ASGI server: `front_door` answers the
    generation routes on `dynamo_ftctl.httpserver` and only the other routes
    go through this app's Starlette router.
    """

    def __init__(self, proxy: MigratingProxy, router: Starlette) -> None:
        self.proxy = proxy
        self.router = router
        self.state = router.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = _GENERATION_ROUTES.get(scope["path"])
            if endpoint is not None:
                body = await _read_body(receive)
                found = {k: v.decode("latin-1") for k, v in scope["headers"]
                         if k in (_PRIORITY_KEY, _REQUEST_ID_KEY)}
                answer = await self.proxy.handle_generation(
                    endpoint, body, found.get(_PRIORITY_KEY), found.get(_REQUEST_ID_KEY))
                await _send_answer(answer, receive, send)
                return
        await self.router(scope, receive, send)


async def _read_body(receive: Any) -> bytes:
    """The whole request body from ASGI `receive` messages."""
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        parts.append(message.get("body", b""))
    return b"".join(parts)


def build_app(inventory: Inventory, config: ProxyConfig, *,
              clock: Clock = SYSTEM_CLOCK) -> ProxyApp:
    """The proxy as an ASGI app; its lifespan opens and closes the upstream pools."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    proxy = MigratingProxy(inventory, config, clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    async def models(_: Request) -> Response:
        return await proxy.handle_models()

    async def health(_: Request) -> Response:
        return _json(200, proxy.health())

    async def metrics_route(_: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        proxy.refresh_busy()
        proxy.refresh_gauges()
        return Response(generate_latest(proxy.metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def busy_threshold(request: Request) -> Response:
        return await proxy.handle_busy_threshold(request)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/busy_threshold", busy_threshold, methods=["GET", "POST"]),
    ]
    router = Starlette(routes=routes, lifespan=lifespan)
    router.state.proxy = proxy
    return ProxyApp(proxy, router)


@dataclass(frozen=True)
class ServeResult:
    """What `serve` reports when the proxy stops."""

    listen: str
    workers: int
    uptime_s: float


def front_door(app: ProxyApp) -> Handler:
    """The `httpserver` handler of the proxy: generations direct, other routes via Starlette."""
    proxy = app.proxy
    routes = _GENERATION_ROUTES
    priority_key = _PRIORITY_KEY

    async def handle(request: HttpRequest) -> Reply | Stream:
        endpoint = routes.get(request.path) if request.method == "POST" else None
        if endpoint is None:
            return await call_asgi(app.router, request)
        priority = request.header(priority_key)
        request_id = request.header(_REQUEST_ID_KEY)
        answer = await proxy.handle_generation(
            endpoint, request.body, None if priority is None else priority.decode("latin-1"),
            None if request_id is None else request_id.decode("latin-1"))
        if isinstance(answer, Collected):
            return await answer.build()
        return answer

    return handle


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when installed (base, not on Windows): ~2x the default loop's request rate."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(inventory: Inventory, config: ProxyConfig, *,
          on_ready: Callable[[str], None] | None = None,
          shutdown_deadline_s: float = 5.0) -> ServeResult:
    """Run the proxy on `config.listen` until SIGTERM or SIGINT (blocking).

    The front door is `dynamo_ftctl.httpserver` (no ASGI server): on a signal it
    stops accepting, lets answers in flight finish for `shutdown_deadline_s`,
    cancels the rest and closes the upstream pools. A second signal cuts the wait
    short. SIGINT then raises `KeyboardInterrupt` (exit 130); SIGTERM returns.
    An address it cannot listen on (in use, not local) is `InvalidInput` (exit 2).
    The front door holds at most `config.max_connections` clients and
    `config.max_buffered_mib` of requests not yet answered (`httpserver`'s caps);
    the soft open-file limit is raised to the hard one first, as Go's runtime does.
    """
    host, _, port = config.listen.rpartition(":")
    host = host.strip("[]")
    install_log_redaction()
    fd_limit = raise_open_file_limit()
    if config.max_connections is not None and config.max_connections > \
            default_max_connections(fd_limit):
        log.warning("proxy.max_connections %d is more than the open-file limit (%d) leaves "
                    "room for (%d): past it, new clients are reset", config.max_connections,
                    fd_limit, default_max_connections(fd_limit))
    app = build_app(inventory, config)
    started = time.monotonic()
    received: list[int] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        hurry = asyncio.Event()

        def on_signal(signum: int) -> None:
            received.append(signum)
            (hurry if stop.is_set() else stop).set()

        await app.proxy.start()
        try:
            try:
                server = await start_server(
                    front_door(app), host, int(port), max_connections=config.max_connections,
                    max_buffered=config.max_buffered_mib * 1024 * 1024)
            except OSError as exc:
                from dynamo_ftctl.errors import InvalidInput

                msg = f"proxy.listen {config.listen}: cannot listen there: {exc.strerror or exc}"
                raise InvalidInput(msg) from None
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, on_signal, signum)
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
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(signum)
        finally:
            await app.proxy.stop()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run())
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return ServeResult(listen=config.listen, workers=len(inventory.workers),
                       uptime_s=round(time.monotonic() - started, 3))
