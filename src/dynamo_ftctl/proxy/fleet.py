"""Fleet state: what the proxy knows of its workers between two requests.

The `Fleet` owns the worker slots (`routing.Balancer`: weights, breakers, outstanding
requests), every worker's load as scraped from its /metrics (and its maximum length
from /v1/models until known), the canary daemon's weights, each worker's busy flag
and the capabilities probed on it (docs/compatibility.md). It scrapes every
`scrape_interval_s` and sets the gauges then; the hot path only counts.

A failure charged to a worker (`charge`) opens its breaker in time, is reported to
the canary daemon (`proxy.health_url`, with `$FTCTL_HEALTH_TOKEN`) and makes its
capabilities be probed again once it answers. Whose fault a failure is, is decided
by the migration policy (`proxy/policy.py`), not here.

Workers found in DNS (the inventory's `discovery:`, `dynamo_ftctl.discovery`) come and
go through the path of an inventory reload (`apply_inventory`): the first resolution is
waited for at `start`, every change after it is applied as it comes.

With `--procs N` each process has its own `Fleet` over the same workers, and the
`FleetBoard` (`proxy/board.py`) makes them one view: every `_SYNC_S` a process
replays the others' request outcomes into its breakers and posts the load its own
requests put on each worker, which admission adds to theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.auth import bearer_headers, token_from_env
from dynamo_ftctl.discovery import Discovery, with_discovered
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.http1 import NoConnection
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.proxy.admission import (
    Thresholds,
    degradation_level,
    is_busy,
    parse_worker_load,
)
from dynamo_ftctl.proxy.balancer import Balancer, WorkerSlot, parse_daemon_weights
from dynamo_ftctl.proxy.board import SharedBalancer
from dynamo_ftctl.proxy.codec import dumps
from dynamo_ftctl.proxy.errors import ScrapeFailed
from dynamo_ftctl.redact import redact_url

if TYPE_CHECKING:
    from dynamo_ftctl.capabilities import CapabilityCache
    from dynamo_ftctl.clock import Clock
    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.inventory import Inventory
    from dynamo_ftctl.inventory.proxy import ProxyConfig
    from dynamo_ftctl.proxy.admission import WorkerLoad
    from dynamo_ftctl.proxy.board import FleetBoard

__all__ = ["Fleet"]

log = logging.getLogger("ftctl.proxy")

# How often a process of `--procs N` reads the board: a breaker opened in one process
# opens in the others within this, and their load estimates lag by as much.
_SYNC_S = 0.05
# A one-token answer is small; more is read no further.
_PROBE_LIMIT = 256 * 1024
# A known-good probe that gets an error is asked again, this many times in all, this far
# apart: past the 0.25 s a batch death takes to reach the proxy (`policy._SETTLE_S`).
_PROBE_TRIES = 3
_PROBE_GAP_S = 0.25


@dataclass(frozen=True, slots=True)
class _Probe:
    """A known-good probe of one worker, and when it started (`Fleet._probe_seq`)."""

    started: int
    task: asyncio.Future[str | None]


class Fleet:
    """The proxy's workers: slots, loads, busy flags, capabilities, daemon weights."""

    def __init__(self, inventory: Inventory, config: ProxyConfig, clock: Clock,
                 http: Client, board: FleetBoard | None = None) -> None:
        self.config = config
        self.http = http  # the proxy's upstream client (the proxy closes it)
        self.clock = clock
        slots = (WorkerSlot(name=w.name, url=w.url, group=inventory.group_of(w), model=w.model)
                 for w in inventory.workers)
        self.board = board
        cache_aware = config.cache_aware if config.routing == "cache_aware" else None
        self.balancer = Balancer(slots, clock=clock, breaker_threshold=config.breaker_threshold,
                             recovery_s=config.breaker_recovery_s,
                             cache_aware=cache_aware) if board is None \
            else SharedBalancer(slots, board, clock=clock,
                              breaker_threshold=config.breaker_threshold,
                              recovery_s=config.breaker_recovery_s, cache_aware=cache_aware)
        default = Thresholds(
            active_decode_blocks_threshold=config.busy.active_decode_blocks_threshold,
            active_prefill_tokens_threshold=config.busy.active_prefill_tokens_threshold,
        )
        self._default_thresholds = default
        self.thresholds: dict[str, Thresholds] = {w.model: default for w in inventory.workers}
        self.loads: dict[str, WorkerLoad | None] = {w.name: None for w in inventory.workers}
        # Whether a canary daemon answered the last poll (None: not asked yet, or none set).
        self.daemon_up: bool | None = None
        self.queued = 0  # requests without a first token yet (the policy counts them)
        self._prompt_tokens_seen = 0
        self._prompts_seen = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workers = {w.name: w for w in inventory.workers}
        self.capabilities: CapabilityCache | None = None
        self._learning: set[str] = set()  # workers whose capability probe is running
        # Known-good probes (`confirm`): the one running per worker, and their order.
        self._confirming: dict[str, _Probe] = {}
        self._probe_seq = itertools.count()
        self._rechecking: set[str] = set()  # absent workers being probed (a scrape's)
        self._static = inventory  # as loaded: without the workers found in DNS
        self.discovery = Discovery(inventory.discovery, clock=clock)
        self._discovering: asyncio.Future[Any] | None = None
        from dynamo_ftctl import metrics

        self.metrics: Any = metrics  # the module (mypyc keeps no module-typed attribute)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the scrape loop."""
        from dynamo_ftctl.capabilities import CapabilityCache

        if self.config.daemon_urls and not token_from_env(self.config.health_token_env):
            log.warning("$%s is not set: worker failures are not reported to the canary "
                        "daemon at %s", self.config.health_token_env,
                        ", ".join(self.config.daemon_urls))
        self.capabilities = CapabilityCache(transport=self.http, clock=self.clock)
        if self._static.discovery:
            await self._follow_dns()
        self._spawn(self._scrape_forever())
        if isinstance(self.balancer, SharedBalancer):
            self._spawn(self._sync_forever(self.balancer))

    async def stop(self) -> None:
        """Stop the scrapes, probes and reports in flight."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.capabilities is not None:
            await self.capabilities.aclose()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _follow_dns(self) -> None:
        """Resolve the discovery entries once, serve what they give, and follow them."""
        if await self.discovery.refresh():
            self._discovered()
        if self._discovering is None:
            self._discovering = self._spawn(self.discovery.run(lambda _: self._discovered()))

    def _discovered(self) -> None:
        log.warning("discovery: %s", self._serve(with_discovered(self._static,
                                                                 self.discovery.workers)))

    async def _sync_forever(self, balancer: SharedBalancer) -> None:
        while True:
            balancer.replay()
            balancer.post_loads()
            await self.clock.asleep(_SYNC_S)

    def _others_load(self, slot: WorkerSlot) -> tuple[int, int]:
        """(KV blocks, prefill tokens) the proxy's other processes hold on `slot`."""
        return (0, 0) if self.board is None else self.board.others_load(slot.name)

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
        jobs = [self._scrape_worker(slot) for slot in self.balancer.slots.values()]
        if self.config.daemon_urls:
            jobs.append(self._poll_daemons(self.config.daemon_urls))
        await asyncio.gather(*jobs, return_exceptions=True)
        self.refresh_busy()
        self.refresh_gauges()

    async def _get(self, url: str) -> bytes:
        timeout_s = max(0.5, min(self.config.scrape_interval_s, 5.0))
        status, body = await self.http.fetch("GET", url, timeout_s=timeout_s)
        if status != 200:
            msg = f"HTTP {status}"
            raise ScrapeFailed(msg)
        return body

    async def _scrape_worker(self, slot: WorkerSlot) -> None:
        # What a worker's probe found missing is not asked for every scrape (a server
        # without /metrics, or whose /v1/models gives no max_model_len, answered every
        # 0.1 s with a 404 or a 500 that dropped the connection).
        if slot.absent and slot.name not in self._rechecking:
            # First: a worker without /metrics returns below, and would never come back.
            self._rechecking.add(slot.name)
            self._spawn(self._recheck_absent(slot))
        caps = self.capabilities.get(slot.name) if self.capabilities is not None else None
        if caps is not None and caps.metrics is False:
            self._watch_capabilities(slot, b"")
            return
        if slot.max_model_len is None and (caps is None or caps.max_model_len is not None):
            with contextlib.suppress(Exception):
                doc = loads(await self._get(f"{slot.url}/v1/models"))
                for entry in doc.get("data", ()):
                    length = entry.get("max_model_len")
                    if entry.get("id") == slot.model and isinstance(length, int):
                        slot.max_model_len = length
        try:
            page = await self._get(f"{slot.url}/metrics")
            slot.kv_blocks_at_scrape = slot.kv_blocks + self._others_load(slot)[0]
            self.loads[slot.name] = parse_worker_load(page.decode("utf-8", "replace"))
        except Exception:  # an unscrapable worker has no load figure; health decides
            self.loads[slot.name] = None
            page = b""
        self._watch_capabilities(slot, page)

    async def _poll_daemons(self, bases: tuple[str, ...]) -> None:
        """Weights from the first canary daemon, in order, that answers (several daemons
        judge alike, each from its own probes; all are asked at once, so each one's
        `ftctl_proxy_daemon_up` is current); none answering: the proxy's own breakers
        alone (fail open), said once in the log when it starts and when it ends."""
        async def ask(base: str) -> dict[str, float] | None:
            try:
                got = parse_daemon_weights(loads(await self._get(f"{base}/workers")))
            except Exception:  # this daemon away: the others may answer
                got = None
            self.metrics.PROXY_DAEMON_UP.labels(redact_url(base)).set(got is not None)
            return got

        answers = await asyncio.gather(*(ask(base) for base in bases))
        weights = next((w for w in answers if w is not None), None)
        up = weights is not None
        if up != self.daemon_up:
            if not up:
                log.warning("no canary daemon answers (%s): the proxy's own breakers decide "
                            "alone until one does", ", ".join(map(redact_url, bases)))
            elif self.daemon_up is False:
                log.warning("a canary daemon answers again: its weights apply")
        self.daemon_up = up
        self.balancer.apply_daemon_weights(weights or {})

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
        field is known from its first refusal on (`note_refused_ids`).
        """
        assert self.capabilities is not None
        worker = self._workers.get(slot.name)
        if worker is None:  # gone (a reload, DNS) before its probe started
            self._learning.discard(slot.name)
            return
        try:
            caps = await self.capabilities.probe(worker)
        finally:
            self._learning.discard(slot.name)
        for endpoint, known in (("completions", caps.token_ids), ("chat", caps.chat_token_ids)):
            if known is not None:
                slot.token_ids[endpoint] = known
        if caps.tokenize is not None:
            slot.tokenize = caps.tokenize
        if caps.max_model_len is not None and slot.max_model_len is None:
            slot.max_model_len = caps.max_model_len

    def note_refused_ids(self, slot: WorkerSlot, endpoint: str, status: int,
                         body: bytes) -> bool:
        """True when `slot` refused the `return_token_ids` field it was sent (now known).

        The caller asks only for an attempt whose body held the field: the capability
        probe may have learnt the same meanwhile, and the request still goes on without it.
        """
        if status not in (400, 422) or b"return_token_ids" not in body:
            return False
        log.warning("%s refuses return_token_ids on /v1/%s: continuing without ids (text)",
                    slot.name, "chat/completions" if endpoint == "chat" else "completions")
        slot.token_ids[endpoint] = False
        return True

    # ------------------------------------------------------------------ reload

    def apply_inventory(self, inventory: Inventory) -> str:
        """Serve `inventory`'s workers from now on (SIGHUP); what changed, in words.

        A worker whose name, URL, model and group stay keeps its slot (breaker, load,
        capabilities); one that changed is a new worker; streams on a worker left out
        run to their end, and no request goes there again. With `--procs N` the workers
        cannot come or go (the fleet board has a cell per worker): `InvalidInput`.
        Discovery entries are followed as `inventory` says from now on; their workers
        last found stay (an entry whose name, model, port and scheme stay keeps them).
        """
        self.discovery.retarget(inventory.discovery)
        summary = self._serve(with_discovered(inventory, self.discovery.workers))
        self._static = inventory
        # Discovery added by a reload of a running proxy (`start` made the capabilities).
        if inventory.discovery and self._discovering is None and self.capabilities is not None:
            self._spawn(self._follow_dns())
        return summary

    def _serve(self, inventory: Inventory) -> str:
        """Route over `inventory.workers` from now on (`apply_inventory`); what changed."""
        old = self.balancer.slots
        slots = []
        for w in inventory.workers:
            slot = old.get(w.name)
            group = inventory.group_of(w)
            if slot is None or (slot.url, slot.model, slot.group) != (w.url, w.model, group):
                slot = WorkerSlot(name=w.name, url=w.url, group=group, model=w.model)
            slots.append(slot)
        added = [s.name for s in slots if old.get(s.name) is not s]
        removed = [name for name in old if name not in {s.name for s in slots}]
        if self.board is not None and {s.name for s in slots} != set(old):
            msg = ("with --procs N the workers cannot be added or removed in place; "
                   "restart the proxy")
            raise InvalidInput(msg)
        self.balancer.replace_slots(slots)
        default = self._default_thresholds
        self.thresholds = {w.model: self.thresholds.get(w.model, default)
                           for w in inventory.workers}
        self.loads = {w.name: self.loads.get(w.name) if w.name not in added else None
                      for w in inventory.workers}
        self._workers = {w.name: w for w in inventory.workers}
        return (f"{len(slots)} workers; added or changed: {', '.join(added) or 'none'}; "
                f"removed: {', '.join(removed) or 'none'}")

    # ------------------------------------------------------------------ failures

    def charge(self, slot: WorkerSlot, reason: str) -> None:
        """Charge a failure to `slot`; it counts once the worker fails a known-good probe too.

        Only then does it move the breaker, reach the canary daemon and make the
        capabilities be probed again: a worker that answers the probe is never taken
        out for a failure that may have been its request's (docs/design.md "Failure
        attribution"). The probe runs apart from the request that charged.
        """
        slot.charges += 1
        self._spawn(self._verify(slot, reason, charged=True))

    def verify(self, slot: WorkerSlot, reason: str) -> None:
        """Probe `slot` after a failure that is not its own (a query of death): a worker
        that fails the known-good probe counts a failure all the same."""
        self._spawn(self._verify(slot, reason, charged=False))

    async def _verify(self, slot: WorkerSlot, reason: str, *, charged: bool) -> None:
        failure = await self.confirm(slot)
        if failure is None:
            if charged:
                self.metrics.UNCONFIRMED_CHARGES.labels(slot.name).inc()
                log.info("%s not charged: it answers the known-good probe (%s)",
                         slot.name, reason)
            self.balancer.record_neutral(slot)
            return
        self.balancer.record_failure(slot)
        self._report_failure(slot, f"{reason}; known-good probe: {failure}")
        if self.capabilities is not None:
            self.capabilities.invalidate(slot.name)  # probed again once it answers

    async def confirm(self, slot: WorkerSlot) -> str | None:
        """Why `slot` fails the known-good request now; None when it answers it.

        The answer always comes from a probe that started after the call, so a worker
        that broke a moment ago is not excused by an older probe; callers that arrive
        while one runs share the next (a burst of charges costs at most two probes).
        """
        asked = next(self._probe_seq)
        while True:
            probe = self._confirming.get(slot.name)
            # A probe that ended is still registered until its done callback runs (a loop
            # iteration later): awaiting it would return at once without yielding, and
            # this loop would spin forever with the event loop blocked (it froze the
            # whole proxy under load). An ended probe counts as none.
            if probe is None or probe.task.done():
                probe = _Probe(next(self._probe_seq), self._spawn(self._probe_known_good(slot)))
                self._confirming[slot.name] = probe
                probe.task.add_done_callback(functools.partial(self._probed, slot.name, probe))
            failure = await asyncio.shield(probe.task)
            if probe.started > asked:
                return failure

    def _probed(self, name: str, probe: _Probe, _: object) -> None:
        if self._confirming.get(name) is probe:
            del self._confirming[name]

    async def _probe_known_good(self, slot: WorkerSlot) -> str | None:
        """One known-good request, asked again (`_PROBE_TRIES` in all, `_PROBE_GAP_S` apart)
        while the worker answers it with an error: a probe batched with a request that
        ends its batch dies with it, and says nothing of the worker. A worker that cannot
        be reached or does not answer in time is not asked twice."""
        from dynamo_ftctl.capabilities import known_good_failure, known_good_request

        body = dumps(known_good_request(slot.model))
        failure: str | None = None
        for attempt in range(_PROBE_TRIES):
            if attempt:
                await self.clock.asleep(_PROBE_GAP_S)
            try:
                status, answer = await self.http.fetch(
                    "POST", f"{slot.url}/v1/completions", body,
                    {"Content-Type": "application/json"},
                    timeout_s=self.config.stall_timeout_s, limit=_PROBE_LIMIT)
            except (NoConnection, TimeoutError) as exc:
                return f"{type(exc).__name__}: {exc}".rstrip(": ")
            except (OSError, ValueError) as exc:  # dropped mid-answer: maybe a batch death
                failure = f"{type(exc).__name__}: {exc}".rstrip(": ")
                continue
            failure = known_good_failure(status, answer)
            if failure is None:
                return None
        return failure

    def spare(self, slot: WorkerSlot, seconds: float | None, status: int) -> None:
        """Backpressure: send `slot` no new request for `seconds` (its Retry-After; the
        proxy's `retry_after_s` without one); it answered `status`."""
        wait = self.config.retry_after_s if seconds is None else seconds
        slot.spared_until = max(slot.spared_until, self.clock.now() + wait)
        slot.full_status = status
        log.info("%s is full: spared for %.3g s", slot.name, wait)

    async def _recheck_absent(self, slot: WorkerSlot) -> None:
        """Probe a worker that said it lacks its model; back in routing once it answers."""
        try:
            if await self.confirm(slot) is None:
                log.info("%s serves %s again", slot.name, slot.model)
                slot.absent = False
        finally:
            self._rechecking.discard(slot.name)

    def full_answer(self, model: str | None) -> tuple[int, int] | None:
        """(status, Retry-After seconds) for a client when workers of `model` are spared by
        backpressure: 429 when one of them said 429, else 503; None when none is spared."""
        wait = self.balancer.spared_for(model)
        if wait is None:
            return None
        now = self.clock.now()
        said = {s.full_status for s in self.balancer.slots.values()
                if (model is None or s.model == model) and s.spared_until > now}
        return (429 if 429 in said else 503), max(1, math.ceil(wait))

    def mark_absent(self, slot: WorkerSlot, evidence: str) -> None:
        """`slot` does not serve its model now: out of routing until a scrape's probe finds it."""
        if not slot.absent:
            log.warning("%s out of routing for %s: %s", slot.name, slot.model, evidence)
        slot.absent = True

    def _report_failure(self, slot: WorkerSlot, reason: str) -> None:
        bases = self.config.daemon_urls
        # Read per report: a token rotated in the environment of a test or embedder counts.
        token = token_from_env(self.config.health_token_env)
        if not bases or not token:
            return  # the daemon refuses unauthenticated reports (start() said so once)
        body = dumps({"worker": slot.name, "ok": False, "reason": reason, "source": "proxy"})
        headers = {"Content-Type": "application/json", **bearer_headers(token)}

        async def post(base: str) -> None:
            with contextlib.suppress(Exception):
                await self.http.fetch("POST", f"{base}/report", body, headers, timeout_s=2.0)

        for base in bases:  # each daemon keeps its own state machines
            self._spawn(post(base))

    # ------------------------------------------------------------------ busy state

    def thresholds_for(self, model: str) -> Thresholds:
        """`model`'s busy thresholds: those set at run time, else `proxy.busy`'s."""
        return self.thresholds.get(model) or self._default_thresholds

    def note_prompt(self, prompt_tokens: int) -> None:
        """A request served with a prompt of `prompt_tokens` (the busy estimate's mean)."""
        self._prompt_tokens_seen += prompt_tokens
        self._prompts_seen += 1

    def _mean_prompt_tokens(self) -> float:
        return self._prompt_tokens_seen / self._prompts_seen if self._prompts_seen else 0.0

    def _busy(self, slot: WorkerSlot, mean_prompt_tokens: float) -> bool:
        kv, prefill = self._others_load(slot)
        slot.busy = is_busy(
            self.loads.get(slot.name), self.thresholds_for(slot.model),
            pending_prefill_tokens=slot.pending_prefill_tokens + prefill,
            mean_prompt_tokens=mean_prompt_tokens, kv_blocks=slot.kv_blocks + kv,
            kv_blocks_at_scrape=slot.kv_blocks_at_scrape,
        )
        return slot.busy

    def busy_flags(self, model: str | None) -> list[bool]:
        """The busy flag of every worker that may serve `model`, worked out now."""
        mean = self._mean_prompt_tokens()
        return [self._busy(slot, mean) for slot in self.balancer.routable(model)]

    def refresh_busy(self) -> None:
        """Work out every worker's busy flag from what is known now."""
        mean = self._mean_prompt_tokens()
        for slot in self.balancer.slots.values():
            self._busy(slot, mean)

    def level(self) -> int:
        """The degradation level (0 to 4) of the healthy capacity as weighted now."""
        return degradation_level(self.balancer.healthy_capacity())

    def refresh_gauges(self) -> None:
        """Set the gauges (each scrape of /metrics and of the workers does).

        The hot path only counts (`queued`, the breakers): a gauge's `set` takes
        a lock, too dear to take three times a request.
        """
        self.metrics.DEGRADATION_LEVEL.set(self.level())
        self.metrics.QUEUED_REQUESTS.set(self.queued)
        for slot in self.balancer.slots.values():
            self.metrics.CIRCUIT_BREAKER_STATE.labels(slot.name).set(
                self.balancer.breaker_gauge(slot),
            )
            self.metrics.WORKER_BUSY.labels(slot.name).set(int(slot.busy))
            self.metrics.DYNAMO_MIGRATION_LIMIT.labels(slot.model).set(
                self.config.migration_limit)

    # ------------------------------------------------------------------ reports

    def health(self) -> dict[str, Any]:
        """The proxy's own health: always fast, no upstream call."""
        self.refresh_busy()
        return {
            "status": "ok",
            "pid": os.getpid(),  # which of `--procs N` answered
            "degradation_level": self.level(),
            "workers": {
                s.name: {"weight": round(self.balancer.weight(s), 3), "breaker": s.breaker,
                         "busy": s.busy, "outstanding": s.outstanding}
                for s in self.balancer.slots.values()
            },
        }

    def models(self) -> dict[str, Any]:
        """The /v1/models list: each model once, with its workers' smallest maximum length."""
        data = []
        for model in dict.fromkeys(s.model for s in self.balancer.slots.values()):
            lens = [s.max_model_len for s in self.balancer.slots.values()
                    if s.model == model and s.max_model_len is not None]
            entry: dict[str, Any] = {"id": model, "object": "model", "owned_by": "ftctl",
                                     "created": 0}
            if lens:
                entry["max_model_len"] = min(lens)
            data.append(entry)
        return {"object": "list", "data": data}

    def busy_threshold_doc(self, model: str) -> dict[str, Any]:
        """`model`'s busy thresholds as the JSON body of `/busy_threshold`."""
        t = self.thresholds_for(model)
        return {"model": model,
                "active_decode_blocks_threshold": t.active_decode_blocks_threshold,
                "active_prefill_tokens_threshold": t.active_prefill_tokens_threshold}
