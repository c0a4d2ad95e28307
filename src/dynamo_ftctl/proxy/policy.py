"""The migration policy: where a request goes next, and whose fault a failure was.

`MigrationPolicy` runs one client request across as many workers as it takes (`answer`
for a whole answer; `streams.stream_generate` drives the same steps for a stream): it
picks a worker (`routing.Balancer`: least outstanding, or cache-aware by the prompt's
prefix, and for a continuation by its prompt and output so far), runs one
upstream attempt on it (`proxy/attempt.py`) and, when the attempt fails, decides
what follows from the request's `StreamLedger` (`proxy/continuation.py` builds the
body): a plain retry before the first token (`method="retry"`), re-prefill of prompt + generated ids
(`"reprefill"`), text continuation for servers without token ids (`"text"`,
docs/design.md "Continuation"), or a KV handoff (`"kv"`, `migrate/handoff.py`).

Failure attribution is `proxy/judgment.py`'s: every failed attempt becomes a
`Verdict` there, and this module only acts on it. The request's fault (a 4xx): it
goes to the client, the worker is charged nothing. Backpressure (429, 503, 529):
the worker is spared for its Retry-After and the request goes elsewhere; with no
other worker, the client gets 429 or 503 with Retry-After. A worker that does not
serve the model now: out of routing for it until a probe finds it, the request goes
elsewhere. The worker's fault: charged (`Fleet.charge`, which moves a breaker only
once the worker fails a known-good probe too). Unknown: the request goes to another
worker, and that worker's outcome decides. Served there: the first worker is
charged. Failed the same way there (`Verdict.way`): a query of death, a 502 of type
`query_of_death`, no further worker, nobody charged
(`ftctl_proxy_query_of_death_total`). A stream cut after its first tokens is
charged at once (the probe decides) and never counts towards a query of death. A
worker the request could not connect to is tried again when no other is left, within
`stall_timeout_s` of the first such failure (`_next_slot`).

Requests that ended other requests' streams (a batch death, `judgment.QueryMemory`)
are remembered by fingerprint: a suspected copy runs on one worker at a time and is
not retried elsewhere; one that kills a second batch is convicted, and copies are
refused with 422 `query_of_death` until the memory forgets them. Retries of requests
with no output yet are capped by `proxy.retry_budget` (Envoy's retry budget): past it
the request fails with a 503 of type `retry_budget_exhausted`
(`ftctl_proxy_retry_budget_exhausted_total`); a worker that went away (refused or
dropped the connection) or is full did no work a retry repeats, so those retries are
not capped.

A failure before any output is `ProxyError` (an HTTP error for the front door to
answer), after it `StreamAborted` (the stream ends with an error event).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.migrate.cost import prefill_reuse
from dynamo_ftctl.openai import error_body
from dynamo_ftctl.proxy.attempt import UpstreamFailure, estimate_prompt_tokens
from dynamo_ftctl.proxy.balancer import WorkerSlot  # dataclass fields' types: read at run
from dynamo_ftctl.proxy.codec import dumps
from dynamo_ftctl.proxy.continuation import (
    NotContinuable,
    continuation_request,
    first_request,
    retry_request,
)
from dynamo_ftctl.proxy.errors import ProxyError, StreamAborted
from dynamo_ftctl.proxy.judgment import Blame, QueryMemory, Verdict, fingerprint, judge
from dynamo_ftctl.proxy.ledger import StreamLedger  # time when compiled (mypyc)
from dynamo_ftctl.proxy.prefix import prefix_key

if TYPE_CHECKING:
    from dynamo_ftctl.clock import Clock
    from dynamo_ftctl.inventory.proxy import ProxyConfig
    from dynamo_ftctl.migrate.handoff import KvHandoff
    from dynamo_ftctl.proxy.attempt import Upstream
    from dynamo_ftctl.proxy.counting import TokenCounter
    from dynamo_ftctl.proxy.fleet import Fleet
    from dynamo_ftctl.proxy.judgment import Outcome

__all__ = ["MigrationPolicy", "ProxyError", "StreamAborted"]

log = logging.getLogger("ftctl.proxy")

# How long a request that failed before its first token on a worker busy with others
# waits for their failures before it goes elsewhere (a batch death arrives as many
# failures within milliseconds; this bounds the wait when the others are fine).
_SETTLE_S = 0.25
# Waits before a request tries again the workers it could not connect to, when no
# other is left (then the last again), all within `stall_timeout_s` of the first.
_REACH_BACKOFF_S = (0.1, 0.3, 1.0)


@dataclass(frozen=True, slots=True)
class _Suspect:
    """A failure that may be the request's doing, charged to `slot` only once it is not."""

    slot: WorkerSlot
    reason: str
    way: str


@dataclass(slots=True)
class _Hold:
    """The lock the copies of one suspected request take in turn, and how many want it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class _Trip:
    """One request's way through the fleet so far: what the policy decides the next step from.

    A plain class, not a dataclass: mypyc compiles this __init__ (a dataclass's is
    generated Python, run per request)."""

    def __init__(self, ledger: StreamLedger, body: dict[str, Any], prompt_estimate: int,
                 model: str | None, *, serial: int) -> None:
        self.ledger = ledger
        self.body = body  # the next upstream body (method "kv": the import's instead)
        self.prompt_estimate = prompt_estimate
        self.model = model
        self.failed_workers: set[str] = set()
        self.failed_groups: set[str] = set()
        # Failed workers the request never reached (no connection made): tried again when
        # no other is left, within `stall_timeout_s` of `unreached_since`.
        self.unreached: set[str] = set()
        self.unreached_since: float | None = None
        self.reach_rounds = 0
        self.yielded = False  # a batch went to the client
        self.queued = True  # no first token yet (counted in `Fleet.queued`)
        self.failed_at: float | None = None  # when the last failure happened (a migration's gap)
        self.source_group = ""
        self.method = ""  # how the next attempt goes on: retry, reprefill, text or kv
        self.kv_payload = b""  # a KV export to import on the next worker (method "kv")
        self.suspect: _Suspect | None = None  # a failure charged once another worker tells whose
        self.retrying = False  # this attempt holds a place in the retry budget
        self.budgeted = False  # the next attempt is a retry the budget caps
        self.serial = serial  # this request among the proxy's (the query memory's key)
        self._print = ""  # its fingerprint, once asked for (`print_`)
        self.held = False  # this attempt runs while the fingerprint is suspected
        self.absent = False  # a worker said it does not serve the model
        # The attempt's body asked for `return_token_ids` (the worker's capability then).
        self.sent_ids = False
        # A counted migration under way (Dynamo's mirror): its migration_type and start.
        self.migrating = ""
        self.migrating_since = 0.0
        # A re-prefill continuation that went on, not counted yet (source group, target
        # group): its method, "kv" or "reprefill", is known once its usage arrives.
        self.uncounted: tuple[str, str] | None = None
        self.pending = 0  # the attempt's prompt estimate, until its first batch

    @property
    def print_(self) -> str:
        """The request's fingerprint (`judgment.fingerprint`), worked out on first use: a
        JSON encoding of the body that only a failure or a non-empty memory needs."""
        if not self._print:
            self._print = fingerprint(self.ledger.body)
        return self._print


class MigrationPolicy:
    """One request's way through the fleet; the retry budget over all of them."""

    def __init__(self, fleet: Fleet, upstream: Upstream, kv: KvHandoff,
                 config: ProxyConfig, clock: Clock, *,
                 counter: TokenCounter | None = None) -> None:
        self.fleet = fleet
        self.counter = counter
        self.upstream = upstream
        self.kv = kv
        self.config = config
        self.clock = clock
        self.metrics = fleet.metrics
        self._in_flight = 0  # requests under way (`start` to `end`)
        self._retries_in_flight = 0  # their retries before a first token (the retry budget)
        self.memory = QueryMemory(clock)
        self._serials = itertools.count(1)
        # Suspected fingerprints run one copy at a time: the lock each copy takes.
        self._holds: dict[str, _Hold] = {}
        # Requests settling after a failure (`_settle`) wait on their worker's event.
        self._failures: dict[str, asyncio.Event] = {}

    async def answer(self, ledger: StreamLedger) -> None:
        """One whole request (`StreamLedger.whole`) across as many workers as it takes: each
        attempt asks for one non-streamed answer (`Upstream.whole`); the answer ends in
        the ledger (`StreamLedger.response`). Raises `ProxyError` when nothing was
        produced, `StreamAborted` after. A streamed request takes the same steps
        (`start`, `begin`, ..., `end`) in `streams.stream_generate`."""
        trip = self.start(ledger)
        ended = "failure"  # how a migration under way ends when the request does
        try:
            while True:
                slot, url, data, headers = await self.begin(trip)
                try:
                    # No await in an except or finally block here: compiled (mypyc), the
                    # exception being handled would be every other task's while this waits.
                    outcome = None
                    try:
                        await self.upstream.whole(slot, url, data, headers, ledger,
                                                  load=self.fleet.loads.get(slot.name))
                    except UpstreamFailure as exc:
                        outcome = exc.outcome
                    if outcome is None:
                        self.batch(trip, slot)
                        await self.succeeded(trip, slot)
                        return
                    if not await self.after_failure(trip, slot, outcome):
                        ledger.finish_chunk("length")
                        return
                finally:
                    self.end_attempt(trip, slot)
        except asyncio.CancelledError:
            ended = "cancelled"
            raise
        finally:
            self.end(trip, ended)

    # ------------------------------------------------------------------ one request's steps

    def start(self, ledger: StreamLedger) -> _Trip:
        """The request's trip, counted in flight and queued (refused when convicted)."""
        model = ledger.body.get("model")
        trip = _Trip(ledger, first_request(ledger),
                     estimate_prompt_tokens(ledger.endpoint, ledger.body),
                     model if isinstance(model, str) else None,
                     serial=next(self._serials))
        if self.memory.remembers() and self.memory.convicted(trip.print_):
            raise self._convicted(ledger, trip.yielded)
        self.fleet.queued += 1
        self._in_flight += 1
        return trip

    async def begin(self, trip: _Trip) -> tuple[WorkerSlot, str, bytes, dict[str, str]]:
        """The next attempt's worker, URL, body and headers, the attempt counted there (and,
        while the request is suspected, its copies' turn taken: `end_attempt` gives it)."""
        ledger = trip.ledger
        slot = await self._next_slot(trip)
        await self._take_turn(trip)
        try:
            ledger.start_attempt(slot.name)
            if trip.method == "kv":
                url, data, headers = self.kv.import_request(slot, trip.kv_payload, ledger)
            else:
                trip.sent_ids = slot.sends_token_ids(ledger.upstream_endpoint)
                url, data, headers = _upstream_request(slot, trip.body, ledger)
        except BaseException:
            self._give_turn(trip)
            raise
        self.fleet.balancer.start(slot, trip.prompt_estimate)
        trip.pending = trip.prompt_estimate
        if trip.method == "retry" and trip.budgeted:
            trip.retrying = True
            self._retries_in_flight += 1
        return slot, url, data, headers

    def batch(self, trip: _Trip, slot: WorkerSlot) -> None:
        """A batch of the attempt reaches the client (the first: the worker's prefill is done)."""
        if trip.pending:
            self._first_batch(trip, slot, trip.pending)
            trip.pending = 0
        if trip.ledger.attempt_tokens and (trip.suspect or trip.retrying):
            self._runs_here(trip)
        trip.yielded = True

    async def succeeded(self, trip: _Trip, slot: WorkerSlot) -> None:
        """The attempt ended the answer: what the worker and the fleet learn from it."""
        ledger = trip.ledger
        self.fleet.balancer.record_success(slot)
        if self.fleet.balancer.prefixes is not None:  # it holds the reply too
            self.fleet.balancer.remember(prefix_key(ledger, trip.model), slot)
        if ledger.count_unsettled:  # it sent no usage chunk
            await self._settle_count(trip)
        if trip.method in ("reprefill", "text"):
            self._prefill_reused(trip, ledger, slot)
        if ledger.prompt_ids is not None:
            self.fleet.note_prompt(len(ledger.prompt_ids))

    def end_attempt(self, trip: _Trip, slot: WorkerSlot) -> None:
        """The attempt ended (any way): its counts on the worker, the budget, the turn."""
        if trip.uncounted is not None:  # it ended without a usage chunk
            self._count_migration(trip, "reprefill")
        self.fleet.balancer.finish(slot, trip.pending)
        if trip.retrying:
            trip.retrying = False
            self._retries_in_flight -= 1
        self._give_turn(trip)

    def end(self, trip: _Trip, ended: str) -> None:
        """The request ended (any way): out of the counts; an untold suspect charged; a
        migration under way ended as `ended` ("cancelled": the client left, "failure")."""
        if trip.queued:
            self.fleet.queued -= 1
        self._in_flight -= 1
        if trip.suspect is not None:  # no other worker told (none left, the client left)
            self.fleet.charge(trip.suspect.slot, trip.suspect.reason)
        if trip.migrating:  # never went on: the client left, or the request failed
            self._migration_ended(trip, ended)

    async def _take_turn(self, trip: _Trip) -> None:
        """While the request's fingerprint is suspected, one copy at a time runs: wait for
        this one's turn (at most `stall_timeout_s`, then 503)."""
        trip.held = self.memory.remembers() and self.memory.suspected(trip.print_)
        if not trip.held:
            return
        hold = self._holds.setdefault(trip.print_, _Hold())
        hold.users += 1
        try:
            async with asyncio.timeout(self.config.stall_timeout_s):
                await hold.lock.acquire()
        except BaseException as exc:
            self._leave_hold(trip, hold)
            trip.held = False
            if isinstance(exc, TimeoutError):
                raise self._held_too_long(trip) from None
            raise

    def _give_turn(self, trip: _Trip) -> None:
        """The attempt that took a turn (`_take_turn`) ended: the next copy's turn."""
        if trip.held:
            hold = self._holds[trip.print_]
            hold.lock.release()
            self._leave_hold(trip, hold)

    def _leave_hold(self, trip: _Trip, hold: _Hold) -> None:
        hold.users -= 1
        if not hold.users:
            del self._holds[trip.print_]

    async def _next_slot(self, trip: _Trip) -> WorkerSlot:
        """The worker for the next attempt; raises when there is none left.

        A connection never made says nothing about the request, nor that the worker is
        gone (a loaded host may not accept in `connect_timeout_s`): when only workers
        the request could not reach are left, it tries them again after a short wait,
        for at most `stall_timeout_s` from its first such failure, as long as a stream
        waits for a token. The migration limit still counts each try.
        """
        while True:
            slot = self._pick(trip)
            if slot is not None:
                return slot
            if not trip.unreached or trip.unreached_since is None:
                raise self._nowhere(trip)
            wait = _REACH_BACKOFF_S[min(trip.reach_rounds, len(_REACH_BACKOFF_S) - 1)]
            if self.clock.now() + wait - trip.unreached_since > self.config.stall_timeout_s:
                raise self._nowhere(trip)
            trip.reach_rounds += 1
            log.info("request %s: no worker left but %s, which it could not connect to; "
                     "trying again in %.1f s", trip.ledger.trace_id,
                     ", ".join(sorted(trip.unreached)), wait)
            await self.clock.asleep(wait)
            trip.failed_workers -= trip.unreached
            slots = self.fleet.balancer.slots
            kept = {slots[name].group for name in trip.failed_workers if name in slots}
            trip.failed_groups -= {slots[name].group for name in trip.unreached
                                   if name in slots} - kept
            trip.unreached.clear()

    def _pick(self, trip: _Trip) -> WorkerSlot | None:
        """The worker for the next attempt, or None when there is none left."""
        failed = trip.failed_workers
        balancer = self.fleet.balancer
        if balancer.prefixes is None:
            slot = balancer.pick(
                model=trip.model, exclude_workers=failed, exclude_groups=trip.failed_groups,
                avoid_busy=not failed, last_resort=bool(failed),
            )
        else:  # a continuation keys its prompt and what it generated so far
            slot = balancer.pick_by_prefix(
                prefix_key(trip.ledger, trip.model), model=trip.model,
                exclude_workers=failed, exclude_groups=trip.failed_groups,
                avoid_busy=not failed, last_resort=bool(failed),
            )
        if slot is None:
            return None
        ledger = trip.ledger
        if slot.max_model_len is not None:
            ledger.max_model_len = min(ledger.max_model_len or slot.max_model_len,
                                       slot.max_model_len)
        return slot

    def _first_batch(self, trip: _Trip, slot: WorkerSlot, pending: int) -> None:
        """The attempt's first batch: the worker's prefill is done, a migration went on."""
        self.fleet.balancer.first_token(slot, pending)
        if trip.queued:
            trip.queued = False
            self.fleet.queued -= 1
        if trip.failed_at is not None:
            # Counted once the stream goes on (a KV import that failed and fell back
            # to re-prefill counts as that).
            gap = self.clock.now() - trip.failed_at
            trip.uncounted = (trip.source_group, slot.group)
            if trip.method != "reprefill":
                self._count_migration(trip, trip.method)
            self.metrics.MIGRATION_DURATION.observe(gap)
            trip.failed_at = None
            self._migration_ended(trip, "success")

    def _count_migration(self, trip: _Trip, method: str) -> None:
        """`ftctl_migrations_total` for the continuation under way, once."""
        if trip.uncounted is not None:
            self.metrics.MIGRATION_TOTAL.labels(*trip.uncounted, method).inc()
            trip.uncounted = None

    def _prefill_reused(self, trip: _Trip, ledger: StreamLedger, slot: WorkerSlot) -> None:
        """A continued stream ended well: how much of its prompt the worker loaded as KV
        (a connector's store, its prefix cache) and how much it computed again; a
        re-prefill that loaded more than the worker's own prefix cache can hold counts as
        a migration of method "kv" (`cost.prefill_reuse`)."""
        prompt, cached = ledger.attempt_prompt_tokens, ledger.attempt_cached_tokens
        if prompt is None or cached is None:
            self._count_migration(trip, "reprefill")
            log.info("request %s continued on %s: the worker reported no cached tokens "
                     "(vLLM: --enable-prompt-tokens-details)", ledger.trace_id, slot.name)
            return
        reuse = prefill_reuse(prompt, cached, ledger.own_context(slot.name))
        self._count_migration(trip, reuse.method)
        self.metrics.MIGRATION_PROMPT_TOKENS.labels(reuse.method, "loaded").inc(reuse.loaded)
        self.metrics.MIGRATION_PROMPT_TOKENS.labels(reuse.method, "recomputed").inc(
            reuse.recomputed)
        log.info("request %s continued on %s (method=%s): %d of %d prompt tokens loaded, "
                 "%d recomputed", ledger.trace_id, slot.name, reuse.method, reuse.loaded,
                 prompt, reuse.recomputed)

    def _migration_ended(self, trip: _Trip, outcome: str) -> None:
        """Dynamo's `model_migration_duration_seconds` for the migration under way."""
        if trip.migrating:
            self.metrics.DYNAMO_MIGRATION_DURATION.labels(
                trip.model or "", trip.migrating, outcome,
            ).observe(self.clock.now() - trip.migrating_since)
            trip.migrating = ""

    def _runs_here(self, trip: _Trip) -> None:
        """The attempt's first token: an earlier suspect is at fault, the retry is done."""
        if trip.suspect is not None:
            # The request runs here: the worker it failed on is at fault.
            self.fleet.charge(trip.suspect.slot, trip.suspect.reason)
            trip.suspect = None
        if trip.retrying:
            trip.retrying = False
            self._retries_in_flight -= 1

    async def _settle(self, trip: _Trip, slot: WorkerSlot) -> None:
        """Before a request that failed on `slot` before its first token goes elsewhere: let
        the failures of the requests batched with it arrive, at most `_SETTLE_S`.

        A batch death reaches the proxy as many failures at once, in no set order; if
        this request is what ended the batch (`QueryMemory`), it must not take its
        poison to another worker's batch. Alone on the worker, it goes on at once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SETTLE_S
        while slot.outstanding > 1 and not self.memory.suspected(trip.print_):
            event = self._failures.setdefault(slot.name, asyncio.Event())
            try:
                async with asyncio.timeout_at(deadline):
                    await event.wait()
            except TimeoutError:
                return

    def _wake_settling(self, slot: WorkerSlot) -> None:
        """A failure on `slot` was noted: requests settling there look again."""
        event = self._failures.pop(slot.name, None)
        if event is not None:
            event.set()

    def _nowhere(self, trip: _Trip) -> Exception:
        """The error when no worker is left for `trip`: full or absent workers say so."""
        failed = trip.failed_workers
        what = "no other healthy worker to continue on" if failed else "no worker available"
        if trip.yielded:
            return StreamAborted(f"stream broken after {trip.ledger.generated_count} "
                                 f"tokens and {what}")
        full = self.fleet.full_answer(trip.model)
        if full is not None:  # backpressure goes on to the client, with its Retry-After
            status, seconds = full
            return ProxyError(status, error_body(
                f"every worker of {trip.model} is full; retry after {seconds} s",
                type="overloaded", code=status), {"Retry-After": str(seconds)})
        if trip.absent:
            return ProxyError(503, error_body(
                f"no worker serves {trip.model} now (they answered that the model is not "
                "there); retry later", type="service_unavailable", code=503),
                {"Retry-After": str(self.config.retry_after_s)})
        status = 502 if failed else 503
        return ProxyError(status, error_body(f"Service unavailable: {what}",
                                             type="service_unavailable", code=status))

    def _refused(self, trip: _Trip, slot: WorkerSlot, outcome: Outcome) -> bool:
        """The request's fault on `slot` (a 4xx): go on (a KV import, token ids it refuses)
        or end the request with the worker's answer (raises)."""
        ledger = trip.ledger
        status, body = outcome.status or 400, outcome.body
        self.fleet.balancer.record_success(slot)  # it answered: a 4xx is not its failure
        if _import_failed(trip.method, ledger, slot, outcome):
            trip.method, trip.kv_payload = "reprefill", b""
            return True
        if trip.method != "kv" and trip.sent_ids and self.fleet.note_refused_ids(
                slot, ledger.upstream_endpoint, status, body):
            return True  # the same body again, without the field
        if trip.suspect is not None:
            # Refused here, it failed there: the request's fault, not that worker's.
            log.info("%s not charged: %s refused the request it failed on (HTTP %d)",
                     trip.suspect.slot.name, slot.name, status)
            self.fleet.verify(trip.suspect.slot, trip.suspect.reason)
            trip.suspect = None
        if not trip.yielded and ledger.generated_count == 0:
            raise ProxyError(status, _refusal_body(status, body)) from None
        message = body.decode("utf-8", "replace")[:200]
        what = "continuation" if ledger.migrations else "request"
        raise StreamAborted(f"{what} refused by {slot.name}: "
                            f"HTTP {status} {message}") from None

    def _spare_or_drop(self, trip: _Trip, slot: WorkerSlot, verdict: Verdict,
                       outcome: Outcome) -> None:
        """`slot` is full (spared for its Retry-After) or does not serve the model (out of
        routing until a probe finds it there): nothing is charged either way."""
        if verdict.blame is Blame.BACKPRESSURE:
            self.metrics.BACKPRESSURE.labels(slot.name).inc()
            self.fleet.spare(slot, verdict.retry_after_s, outcome.status or 503)
        else:
            self.fleet.mark_absent(slot, verdict.evidence)
            trip.absent = True

    async def after_failure(self, trip: _Trip, slot: WorkerSlot, outcome: Outcome) -> bool:
        """The attempt on `slot` failed: act on the judgment's verdict, choose how the
        request goes on.

        False when the output is complete by length (the caller ends it cleanly);
        raises when the request must end (its own fault, query of death, retry budget,
        limits).
        """
        ledger = trip.ledger
        verdict = judge(outcome, trip.model, ledger.attempt_tokens)
        if verdict.blame is Blame.REQUEST:
            return self._refused(trip, slot, outcome)
        if verdict.blame in (Blame.BACKPRESSURE, Blame.ABSENT):
            self._spare_or_drop(trip, slot, verdict, outcome)
            if not ledger.attempt_tokens:  # it did no work: the same request elsewhere
                trip.failed_workers.add(slot.name)
                trip.budgeted = False
                if trip.method == "kv":  # the export is spent: the next worker re-prefills
                    trip.method, trip.kv_payload = "reprefill", b""
                return True
        if _import_failed(trip.method, ledger, slot, outcome):
            trip.method, trip.kv_payload = "reprefill", b""
            return True
        reason = f"{verdict.evidence}"
        log.warning("worker failed: %s [%s] (after %d tokens)", reason, verdict.blame.value,
                    ledger.generated_count)
        if verdict.blame is Blame.UNKNOWN:
            convicted = self.memory.note_failure(slot.name, trip.serial, trip.print_,
                                                 ledger.attempt_tokens, held=trip.held)
            self._wake_settling(slot)
            if not ledger.attempt_tokens and not trip.held:
                await self._settle(trip, slot)
            if trip.print_ in convicted or (
                    not ledger.attempt_tokens and self.memory.suspected(trip.print_)):
                if await self.fleet.confirm(slot) is None:
                    # The worker lives on, and this request ended the streams batched
                    # with it (or a copy did): not tried on another worker, whose batch
                    # it would end too.
                    trip.suspect = None
                    raise self._convicted(ledger, trip.yielded, slot)
                # The worker died (a crash, a kill): no request is to blame for that.
                self.memory.forgive(trip.print_)
        way = verdict.way
        suspect = trip.suspect
        if way is not None and suspect is not None and suspect.way == way:
            trip.suspect = None
            raise self._query_of_death(ledger, suspect.slot, slot, way, trip.yielded) from None
        if suspect is not None:  # failed another way here: both workers' fault
            self.fleet.charge(suspect.slot, suspect.reason)
            trip.suspect = None
        if way is None:
            if verdict.blame in (Blame.WORKER, Blame.UNKNOWN):
                self.fleet.charge(slot, reason)
        else:
            trip.suspect = _Suspect(slot, reason, way)
        trip.failed_workers.add(slot.name)
        trip.failed_groups.add(slot.group)
        if outcome.kind == "unreachable":
            trip.unreached.add(slot.name)
            if trip.unreached_since is None:
                trip.unreached_since = self.clock.now()
        else:  # it failed the request another way: never tried again
            trip.unreached.discard(slot.name)
        if ledger.count_unsettled:  # before the continuation's max_tokens is worked out
            await self._settle_count(trip)
        trip.failed_at = self.clock.now()
        trip.source_group = slot.group
        if ledger.endpoint == "chat" and not ledger.exact and ledger.chat_template is None \
                and self.counter is not None:
            # A text chat goes on through the model's own template where the inventory
            # names its tokenizer directory (servers that cannot continue a message).
            ledger.chat_template = self.counter.chat_template(self._counting_slots(trip))
        trip.body, trip.method = self._next_body(ledger, reason)
        if not trip.body:
            return False
        # A worker that went away did no work a retry repeats: the load moves (issue
        # 22's drill: a SIGKILLed vLLM's queued requests got 503 past the budget).
        # Answered failures and timeouts are capped.
        trip.budgeted = trip.method == "retry" and outcome.kind not in ("unreachable", "lost")
        if trip.budgeted and not self._retry_allowed():
            raise self._retry_refused(reason, trip.yielded) from None
        # Dynamo's mirror counts the decision to go on (its frontend counts before
        # re-issuing); ftctl_migrations_total counts the stream going on.
        migration_type = "new_request" if trip.method == "retry" else "ongoing_request"
        self.metrics.DYNAMO_MIGRATION_TOTAL.labels(trip.model or "", migration_type).inc()
        if not trip.migrating:  # one duration from the first failure to the end
            trip.migrating, trip.migrating_since = migration_type, trip.failed_at
        export_s = self.kv.export_budget(ledger) if trip.method == "reprefill" else 0
        if export_s:
            trip.kv_payload = await self.kv.export(slot, ledger, export_s)
            if trip.kv_payload:
                trip.method = "kv"
        if trip.method == "reprefill":  # workers sharing a KV store: load or recompute
            trip.body = self.kv.store_choice(trip.body)
        return True

    async def _settle_count(self, trip: _Trip) -> None:
        """Count the text of an attempt that sent no ids and no usage chunk (a worker cut
        mid-stream, or one that ignores `include_usage`): /tokenize on a worker of the
        model, else the inventory's tokenizer, else its chunks stand. The client's
        prompt, never counted yet, is counted the same way."""
        ledger = trip.ledger
        if self.counter is None:
            return
        slots = self._counting_slots(trip)
        counted = await self.counter.count(slots, trip.model, text=ledger.attempt_text)
        if counted is not None:
            ledger.settle_attempt(*counted)
        if ledger.prompt_ids is None and ledger.prompt_tokens_reported is None:
            body = ledger.body
            prompt = body.get("prompt")
            found = await self.counter.count(
                slots, trip.model, text=prompt if isinstance(prompt, str) else None,
                messages=body.get("messages") if ledger.endpoint == "chat" else None)
            if found is not None and (ledger.endpoint == "completions" or found[1] == "tokenize"):
                ledger.prompt_tokens_reported = found[0]

    def _counting_slots(self, trip: _Trip) -> list[WorkerSlot]:
        """The workers of the request's model, those that did not fail it first."""
        slots = [s for s in self.fleet.balancer.slots.values()
                 if trip.model is None or s.model == trip.model]
        return sorted(slots, key=lambda s: s.name in trip.failed_workers)

    def _query_of_death(self, ledger: StreamLedger, first: WorkerSlot, second: WorkerSlot,
                        way: str, yielded: bool) -> Exception:
        """The error that ends a request that failed `way` on two workers (neither charged).

        The request, not the fleet, is the suspect: tried on every worker, it would
        open every breaker, and a few such requests would take the whole cluster down.
        Each worker is still asked the known-good request: one that
        fails it too counts a failure. A half-open breaker whose trial it was may
        try again.
        """
        self.fleet.verify(first, f"query of death ({way})")
        self.fleet.verify(second, f"query of death ({way})")
        self.metrics.QUERY_OF_DEATH.inc()
        log.warning("query of death: request %s failed the same way (%s) on %s and %s; "
                    "not tried on more workers, neither charged",
                    ledger.trace_id, way, first.name, second.name)
        message = (f"the request failed the same way ({way}) on two workers "
                   f"({first.name}, {second.name}); it is not tried on more workers, "
                   "as it may be what breaks them")
        if yielded:
            return StreamAborted(message, "query_of_death")
        return ProxyError(502, error_body(message, type="query_of_death", code=502))

    def _convicted(self, ledger: StreamLedger, yielded: bool,
                   slot: WorkerSlot | None = None) -> Exception:
        """The error for a request whose copies ended other requests' streams (422)."""
        self.metrics.QUERY_OF_DEATH.inc()
        where = f" (last on {slot.name})" if slot is not None else ""
        log.warning("query of death: request %s ended other requests' streams%s; refused",
                    ledger.trace_id, where)
        message = ("this request ended the streams of other requests batched with it"
                   f"{where}; it is refused for a while, as it may be what breaks workers")
        if yielded:
            return StreamAborted(message, "query_of_death")
        return ProxyError(422, error_body(message, type="query_of_death", code=422))

    def _held_too_long(self, trip: _Trip) -> Exception:
        """The error for a suspected copy that waited `stall_timeout_s` for its turn."""
        message = ("a copy of this request is running, and such copies run one at a time "
                   "(they ended other requests' streams); please retry later")
        if trip.yielded:
            return StreamAborted(message, "query_of_death")
        return ProxyError(503, error_body(message, type="query_of_death", code=503),
                          {"Retry-After": str(self.config.retry_after_s)})

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
        return ProxyError(503, error_body(message, type="retry_budget_exhausted", code=503),
                          {"Retry-After": str(self.config.retry_after_s)})

    def _next_body(self, ledger: StreamLedger, reason: str) -> tuple[dict[str, Any], str]:
        """The next upstream body and the migration method; ({}, "") ends with "length"."""
        if ledger.generated_count == 0:
            if ledger.migrations >= ledger.migration_limit:
                raise self._give_up(ledger, f"{reason}; migration limit "
                                    f"({ledger.migration_limit}) reached")
            ledger.note_migration()
            return retry_request(ledger), "retry"
        try:
            body = continuation_request(ledger)
        except NotContinuable as exc:
            if exc.finish_reason is not None:
                return {}, ""
            raise self._give_up(ledger, f"{reason}; {exc}") from None
        ledger.note_migration()
        return body, "reprefill" if ledger.exact else "text"

    @staticmethod
    def _give_up(ledger: StreamLedger, message: str) -> Exception:
        if ledger.generated_count == 0 and not ledger.migrations:
            return ProxyError(502, error_body(message, type="worker_failed", code=502))
        return StreamAborted(message)


def _upstream_request(slot: WorkerSlot, body: dict[str, Any],
                      ledger: StreamLedger) -> tuple[str, bytes, dict[str, str]]:
    """URL, body and headers of a generation on `slot` (without ids where it refuses them).

    `X-Request-Id` is the attempt's own id (`StreamLedger.upstream_id`), never the
    client's: the client's goes as `X-Ftctl-Trace-Id`.
    """
    if not slot.sends_token_ids(ledger.upstream_endpoint):
        body = {k: v for k, v in body.items() if k != "return_token_ids"}
    return (f"{slot.url}{ledger.upstream_path}", dumps(body),
            {"Content-Type": "application/json", "X-Request-Id": ledger.upstream_id,
             "X-Ftctl-Trace-Id": ledger.trace_id})


def _import_failed(method: str, ledger: StreamLedger, slot: WorkerSlot,
                   outcome: Outcome) -> bool:
    """A KV import that failed before its first token (the caller re-prefills)."""
    if method != "kv" or ledger.attempt_tokens:
        return False
    log.warning("KV import on %s failed (%s); re-prefilling", slot.name, outcome.message)
    return True


def _refusal_body(status: int, body: bytes) -> dict[str, Any]:
    """The client's answer to a 4xx: the worker's JSON error, or its text in one."""
    try:
        doc = loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        return doc
    return error_body(body.decode("utf-8", "replace")[:500],
                      type="invalid_request_error", code=status)
