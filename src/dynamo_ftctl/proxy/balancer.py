"""Routing: least outstanding requests, weighted by health, with a passive breaker.

Each worker has a routing weight in [0, 1]. When the canary daemon runs, its
`GET /workers` gives the weights (HEALTHY 1, SUSPICIOUS 0.5, UNHEALTHY and
beyond 0); otherwise the proxy's own breaker does: `breaker_threshold`
consecutive failures open it (weight 0), after `recovery_s` one trial request
goes through (half-open, weight 0.5), a success closes it again. A request that
failed through its own fault (a query of death, `record_neutral`) is neither: the
next request may be the trial.

`pick` chooses the worker with the smallest (outstanding + 1) / weight among
those not excluded (the workers and groups that already failed this request)
and not busy; ties go round-robin so equal workers share the load. A worker
with weight 0 is chosen only when nothing else is left for a continuation
(`last_resort=True`): a stream broken half-way is worth a try on a suspect
worker rather than an error.

Cache-aware routing (`proxy.routing: cache_aware`, `pick_by_prefix`) is sglang-router's
and vllm-router's `cache_aware` policy over the same eligible workers: while the load
is in balance, the request goes to the worker holding the longest prefix of its
prompt (and, for a continuation, of what it generated) in the `prefix.PrefixIndex`,
when that prefix is more than `cache_threshold` of the key; else to the eligible
worker holding the fewest blocks (new prefixes spread over the caches). When the
outstanding requests of the most and least loaded eligible workers differ by more
than `balance_abs_threshold` and the first is more than `balance_rel_threshold`
times the second, `pick` decides. The chosen worker is recorded as holding the key
at once (requests of one prefix that arrive together go to one worker). A worker
whose breaker opens is forgotten (a restart empties its cache), so is one a reload
removes.

Pure code with a `Clock`; no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.proxy.prefix import PrefixIndex

if TYPE_CHECKING:
    from dynamo_ftctl.inventory.proxy import CacheAware
    from dynamo_ftctl.proxy.prefix import PrefixKey

__all__ = ["Balancer", "BreakerState", "WorkerSlot", "parse_daemon_weights"]

BreakerState = Literal["closed", "open", "half_open"]
_BREAKER_GAUGE = {"closed": 0, "open": 1, "half_open": 2}

# Weights of the canary daemon's states (docs/design.md "Health states": SUSPICIOUS
# routes at half weight).
_STATE_WEIGHTS = {
    "healthy": 1.0, "suspicious": 0.5, "unhealthy": 0.0, "draining": 0.0, "dead": 0.0,
}


@dataclass
class WorkerSlot:
    """The proxy's live view of one worker."""

    name: str
    url: str
    group: str
    model: str
    outstanding: int = 0
    pending_prefill_tokens: int = 0
    # KV blocks the prompt and output tokens of this proxy's requests fill on the
    # worker, and the same when its /metrics was last scraped (admission moves the
    # scraped usage by the difference).
    kv_blocks: int = 0
    kv_blocks_at_scrape: int = 0
    consecutive_failures: int = 0
    breaker: BreakerState = "closed"
    opened_at: float = 0.0
    trial_in_flight: bool = False
    daemon_weight: float | None = None
    busy: bool = False
    max_model_len: int | None = None
    failures: int = 0  # confirmed: the worker failed a known-good probe too
    successes: int = 0
    charges: int = 0  # failures charged, confirmed or not (`Fleet.charge`)
    # Backpressure: no new requests before this time (its Retry-After, `Fleet.spare`).
    spared_until: float = 0.0
    full_status: int = 503  # what it answered then (429, 503 or 529)
    # The worker said it does not serve its model (now): out until a probe finds it.
    absent: bool = False
    # Whether the worker answers POST /tokenize (its capability probe; None: not known):
    # the proxy counts an attempt's text there when the worker returned no ids.
    tokenize: bool | None = None
    # Whether the worker takes `return_token_ids` on each endpoint (None: not known yet,
    # sent; False: it refused the field or returns no ids, never sent). From its
    # capability probe, or learnt from a refusal that names the field.
    token_ids: dict[str, bool | None] = field(
        default_factory=lambda: {"completions": None, "chat": None})

    def sends_token_ids(self, endpoint: str) -> bool:
        """Whether requests to `endpoint` ("completions" or "chat") ask for token ids."""
        return self.token_ids.get(endpoint) is not False

    def weight(self, now: float, recovery_s: float) -> float:
        """Routing weight: the daemon's when known, else the breaker's; 0 while spared or
        absent."""
        if self.absent or now < self.spared_until:
            return 0.0
        if self.breaker == "open" and now - self.opened_at >= recovery_s:
            self.breaker = "half_open"
        if self.breaker == "open":
            return 0.0
        own = (0.0 if self.trial_in_flight else 0.5) if self.breaker == "half_open" else 1.0
        if self.daemon_weight is not None:
            return min(own, self.daemon_weight) if own < 1.0 else self.daemon_weight
        return own


def parse_daemon_weights(doc: Any) -> dict[str, float]:
    """Weights by worker name from the canary daemon's `GET /workers` JSON.

    Accepts `{"workers": [{"name", "weight"|"state"}...]}`, a bare list of such
    objects, or a mapping name -> {"weight"|"state"} / name -> number.
    """
    items: Iterable[tuple[str, Any]]
    if isinstance(doc, dict) and isinstance(doc.get("workers"), list | dict):
        doc = doc["workers"]
    if isinstance(doc, list):
        items = ((str(e.get("name", e.get("worker", ""))), e) for e in doc if isinstance(e, dict))
    elif isinstance(doc, dict):
        items = ((str(k), v) for k, v in doc.items())
    else:
        msg = "expected a list or mapping of workers"
        raise ValueError(msg)
    out: dict[str, float] = {}
    for name, entry in items:
        if not name:
            continue
        weight: Any = entry
        if isinstance(entry, dict):
            weight = entry.get("weight")
            if weight is None and isinstance(entry.get("state"), str):
                weight = _STATE_WEIGHTS.get(entry["state"].lower())
        if isinstance(weight, int | float) and not isinstance(weight, bool):
            out[name] = min(1.0, max(0.0, float(weight)))
    return out


class Balancer:
    """Chooses workers and keeps their outstanding counts, breakers and weights."""

    def __init__(
        self, slots: Iterable[WorkerSlot], *, clock: Clock = SYSTEM_CLOCK,
        breaker_threshold: int = 3, recovery_s: float = 60.0,
        cache_aware: CacheAware | None = None,
    ) -> None:
        self.slots: dict[str, WorkerSlot] = {s.name: s for s in slots}
        # Cache-aware routing's settings and index (None: least outstanding only).
        self.cache_aware = cache_aware
        self.prefixes = PrefixIndex(cache_aware.max_entries) if cache_aware else None
        self._order = list(self.slots)
        self._clock = clock
        self._threshold = breaker_threshold
        self._recovery_s = recovery_s
        self._rotation = itertools.count()

    def replace_slots(self, slots: Iterable[WorkerSlot]) -> None:
        """Route over `slots` from now on (an inventory reload). Requests running on a slot
        left out keep it to their end; none is sent there again."""
        if self.prefixes is not None:
            for gone in self.slots.keys() - {s.name for s in slots}:
                self.prefixes.forget(gone)
        self.slots = {s.name: s for s in slots}
        self._order = list(self.slots)

    def weight(self, slot: WorkerSlot) -> float:
        """`slot.weight` at the clock's now (an open breaker past `recovery_s` turns half-open)."""
        return slot.weight(self._clock.now(), self._recovery_s)

    def routable(self, model: str | None = None) -> list[WorkerSlot]:
        """Workers with a positive weight that serve `model` (any model when None)."""
        return [
            s for s in self.slots.values()
            if (model is None or s.model == model) and self.weight(s) > 0
        ]

    def spared_for(self, model: str | None) -> float | None:
        """Seconds until the first worker of `model` spared by backpressure takes requests
        again; None when none is spared."""
        now = self._clock.now()
        left = [s.spared_until - now for s in self.slots.values()
                if (model is None or s.model == model) and s.spared_until > now]
        return min(left) if left else None

    def healthy_capacity(self) -> float:
        """Sum of weights over the number of workers (1.0 when all are healthy)."""
        if not self.slots:
            return 0.0
        return sum(self.weight(s) for s in self.slots.values()) / len(self.slots)

    def serves(self, model: str) -> bool:
        """Whether any worker, routable or not, is configured for `model`."""
        return any(s.model == model for s in self.slots.values())

    def pick(
        self, *, model: str | None = None, exclude_workers: Collection[str] = (),
        exclude_groups: Collection[str] = (), avoid_busy: bool = True,
        last_resort: bool = False,
    ) -> WorkerSlot | None:
        """The least loaded eligible worker, or None when there is none.

        `avoid_busy` prefers workers that are not busy; an admitted request still
        goes to the least loaded busy one when every worker is busy (admission
        has already decided it may queue), rather than being refused here.
        """
        start = next(self._rotation)
        count = len(self._order)
        best: WorkerSlot | None = None
        best_score = float("inf")
        busy_best: WorkerSlot | None = None
        busy_score = float("inf")
        fallback: WorkerSlot | None = None
        for offset in range(count):
            slot = self.slots[self._order[(start + offset) % count]]
            if slot.name in exclude_workers or slot.group in exclude_groups:
                continue
            if model is not None and slot.model != model:
                continue
            weight = self.weight(slot)
            if weight <= 0:
                # Not one that is full or does not serve the model: it would only say so again.
                if last_resort and fallback is None and not slot.absent \
                        and slot.spared_until <= self._clock.now():
                    fallback = slot
                continue
            score = (slot.outstanding + 1) / weight
            if avoid_busy and slot.busy:
                if score < busy_score:
                    busy_best, busy_score = slot, score
                continue
            if score < best_score:
                best, best_score = slot, score
        if best is None:
            best = busy_best or fallback
        if best is not None and best.breaker == "half_open":
            best.trial_in_flight = True
        return best

    def pick_by_prefix(
        self, key: PrefixKey | None, *, model: str | None = None,
        exclude_workers: Collection[str] = (), exclude_groups: Collection[str] = (),
        avoid_busy: bool = True, last_resort: bool = False,
    ) -> WorkerSlot | None:
        """Cache-aware choice (see the module's docstring) among the workers `pick` would
        consider, and `key` recorded on the worker chosen; `pick`'s when there is no key,
        no index, the load is out of balance, or only a last resort is left."""
        settings, index = self.cache_aware, self.prefixes
        slot: WorkerSlot | None = None
        if settings is not None and index is not None and key is not None:
            candidates = self._eligible(model, exclude_workers, exclude_groups, avoid_busy)
            if candidates and not _imbalanced(candidates, settings):
                slot = _by_prefix(candidates, key, index, settings.cache_threshold)
                if slot.breaker == "half_open":
                    slot.trial_in_flight = True
        if slot is None:
            slot = self.pick(model=model, exclude_workers=exclude_workers,
                             exclude_groups=exclude_groups, avoid_busy=avoid_busy,
                             last_resort=last_resort)
        if slot is not None and index is not None and key is not None:
            index.insert(key, slot.name)
        return slot

    def remember(self, key: PrefixKey | None, slot: WorkerSlot) -> None:
        """`slot` served `key` (a finished request's prompt and output)."""
        if self.prefixes is not None and key is not None:
            self.prefixes.insert(key, slot.name)

    def _eligible(self, model: str | None, exclude_workers: Collection[str],
                  exclude_groups: Collection[str], avoid_busy: bool) -> list[WorkerSlot]:
        """The workers `pick` chooses among before a last resort: of `model`, not
        excluded, of positive weight; the ones not busy when any is and `avoid_busy`."""
        free: list[WorkerSlot] = []
        busy: list[WorkerSlot] = []
        for slot in self.slots.values():
            if slot.name in exclude_workers or slot.group in exclude_groups \
                    or (model is not None and slot.model != model) or self.weight(slot) <= 0:
                continue
            (busy if avoid_busy and slot.busy else free).append(slot)
        return free or busy

    def start(self, slot: WorkerSlot, prompt_tokens: int) -> None:
        """A request goes to `slot`."""
        slot.outstanding += 1
        slot.pending_prefill_tokens += prompt_tokens

    def first_token(self, slot: WorkerSlot, prompt_tokens: int) -> None:
        """The worker produced the first token: its prefill of that prompt is done."""
        slot.pending_prefill_tokens = max(0, slot.pending_prefill_tokens - prompt_tokens)

    def finish(self, slot: WorkerSlot, prompt_tokens_pending: int) -> None:
        """The request left `slot` (success, failure or client disconnect)."""
        slot.outstanding = max(0, slot.outstanding - 1)
        slot.pending_prefill_tokens = max(0, slot.pending_prefill_tokens - prompt_tokens_pending)

    def record_success(self, slot: WorkerSlot) -> None:
        """A stream from `slot` ended well: close its breaker."""
        slot.successes += 1
        slot.consecutive_failures = 0
        slot.trial_in_flight = False
        slot.breaker = "closed"

    def record_failure(self, slot: WorkerSlot) -> None:
        """A stream from `slot` failed: count it; open the breaker at the threshold."""
        slot.failures += 1
        slot.consecutive_failures += 1
        slot.trial_in_flight = False
        if slot.breaker == "half_open" or slot.consecutive_failures >= self._threshold:
            slot.breaker = "open"
            slot.opened_at = self._clock.now()
            if self.prefixes is not None:
                self.prefixes.forget(slot.name)

    def record_neutral(self, slot: WorkerSlot) -> None:
        """An attempt on `slot` failed through the request's fault (a query of death).

        Neither a success nor a failure of the worker; a half-open breaker whose
        trial it was may try the next request.
        """
        slot.trial_in_flight = False

    def apply_daemon_weights(self, weights: Mapping[str, float]) -> None:
        """Take the canary daemon's weights; workers it does not list keep their own."""
        for name, slot in self.slots.items():
            slot.daemon_weight = weights.get(name)

    def breaker_gauge(self, slot: WorkerSlot) -> int:
        """0 closed, 1 open, 2 half-open (for `ftctl_circuit_breaker_state`)."""
        self.weight(slot)
        return _BREAKER_GAUGE[slot.breaker]


def _imbalanced(slots: list[WorkerSlot], settings: CacheAware) -> bool:
    """sglang-router's test: max - min > abs and max > rel * min (outstanding requests)."""
    loads = [s.outstanding for s in slots]
    high, low = max(loads), min(loads)
    return high - low > settings.balance_abs_threshold \
        and high > settings.balance_rel_threshold * low


def _by_prefix(slots: list[WorkerSlot], key: PrefixKey, index: PrefixIndex,
               threshold: float) -> WorkerSlot:
    """The worker holding the longest prefix of `key` when it is more than `threshold` of
    it, else the one holding the fewest blocks; ties to the fewest outstanding."""
    held = index.match(key)
    best = max(slots, key=lambda s: (held.get(s.name, 0), -s.outstanding))
    matched = held.get(best.name, 0) * key.unit
    if key.length and matched / key.length > threshold:
        return best
    return min(slots, key=lambda s: (index.held_by(s.name), s.outstanding))
