"""Admission control: busy workers, degradation levels and priority shedding.

- **Busy.** A worker is busy when its KV cache usage exceeds
  `active_decode_blocks_threshold` (a fraction, from `vllm:kv_cache_usage_perc`)
  or its prefill backlog exceeds `active_prefill_tokens_threshold` (tokens:
  prompt tokens this proxy sent that have not produced a first token yet, or
  the worker's waiting requests times the mean prompt length seen, whichever is
  larger). Data-parallel ranks of one worker (label `engine`, `dp_rank` or
  `data_parallel_rank` on the metrics) make the worker busy only when every
  rank is busy. When every routable worker is busy, the request gets HTTP 503
  (or 529) with `Retry-After` and `BUSY_BODY`.
- **Now, not at the next scrape.** Between two scrapes the KV usage moves with
  the proxy's own requests: the blocks their prompt and output tokens fill on
  the worker, over the pool's size from `vllm:cache_config_info` (vLLM's and
  the sim's). Dynamo's router counts the blocks of the requests it routed the
  same way (its active decode blocks over the worker's total blocks); counted only
  at a scrape every second, a filling worker would look free for up to a second.
- **No lock-in.** KV held by a rank that runs nothing and queues nothing is
  cache, not load (Dynamo counts active decode blocks, vLLM counts evictable
  blocks free), so such a rank is never busy for its KV usage. Without this, a
  worker whose figure counts idle blocks (retained KV) would be busy for as long
  as it stays idle, and stay idle because it is busy: every request refused,
  nothing reaches the worker to free them. A rank that
  does run or queue requests finishes them without the proxy's help, so its
  figure falls by itself; a worker whose metrics cannot be read counts only the
  proxy's own backlog (as Dynamo counts a rank without data free). No trickle of
  probe requests is needed, and none is sent to a worker that is really full.
- **Degradation.** The ratio of healthy capacity (sum of routing weights over
  the number of workers) gives a level: 0 (≥ 1), 1 (≥ 0.75), 2 (≥ 0.5),
  3 (≥ 0.25), 4 (below).
- **Priority.** `x-ftctl-priority: premium|standard|best_effort` (default
  standard). `SHED_AT_LEVEL` lists the tiers refused at each level:
  best_effort goes first, then standard. Premium is not refused for
  busyness: when every worker is busy it queues at the least-loaded one
  (the proxy's `premium_when_busy: admit`, the default; `shed` refuses it
  like the rest); it is refused only when no worker is healthy.

Pure code: parsing and decisions. The proxy scrapes `/metrics` and feeds the
results in; thresholds change at run time through `set_thresholds`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "BUSY_BODY",
    "PRIORITIES",
    "SHED_AT_LEVEL",
    "Decision",
    "Priority",
    "Thresholds",
    "WorkerLoad",
    "decide",
    "degradation_level",
    "is_busy",
    "parse_priority",
    "parse_worker_load",
]

Priority = Literal["premium", "standard", "best_effort"]
PRIORITIES: tuple[Priority, ...] = ("premium", "standard", "best_effort")

# The body Dynamo's frontend answers with when every worker is busy.
BUSY_BODY: dict[str, Any] = {
    "message": "Service temporarily unavailable: All workers are busy, please retry later",
    "type": "service_unavailable",
    "code": 503,
}

# Tiers refused at each degradation level. At level 1 a quarter of the capacity
# is gone: the best-effort traffic makes room for the rest. Below half (level 3)
# standard traffic is refused too, so that premium keeps its latency.
SHED_AT_LEVEL: Mapping[int, frozenset[Priority]] = {
    0: frozenset(),
    1: frozenset({"best_effort"}),
    2: frozenset({"best_effort"}),
    3: frozenset({"best_effort", "standard"}),
    4: frozenset({"best_effort", "standard"}),
}

_KV_USAGE = "vllm:kv_cache_usage_perc"
_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM before 0.10
_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_CACHE_CONFIG = "vllm:cache_config_info"  # labels block_size and num_gpu_blocks, value 1
_RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")


@dataclass(frozen=True)
class Thresholds:
    """When a worker counts as busy (changeable at run time)."""

    active_decode_blocks_threshold: float = 0.85
    active_prefill_tokens_threshold: int = 8192

    def __post_init__(self) -> None:
        decode = self.active_decode_blocks_threshold
        if not (isinstance(decode, int | float) and 0.0 <= decode <= 1.0):
            msg = f"active_decode_blocks_threshold must be within [0, 1], got {decode!r}"
            raise ValueError(msg)
        prefill = self.active_prefill_tokens_threshold
        if isinstance(prefill, bool) or not isinstance(prefill, int) or prefill < 0:
            msg = f"active_prefill_tokens_threshold must be an integer >= 0, got {prefill!r}"
            raise ValueError(msg)


@dataclass(frozen=True)
class RankLoad:
    """The load of one data-parallel rank of a worker."""

    kv_usage: float = 0.0
    waiting: int = 0
    running: int | None = None  # None: the worker does not say

    @property
    def decode_load(self) -> float:
        """The KV usage that is load: none while the rank runs and queues nothing."""
        if self.running == 0 and self.waiting == 0:
            return 0.0
        return self.kv_usage


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as scraped from its `/metrics`: one entry per DP rank."""

    ranks: tuple[RankLoad, ...] = ()
    pool_blocks: int = 0  # blocks in one rank's KV pool (0: the worker does not say)
    block_size: int = 0  # tokens a block holds (0: the worker does not say)


def parse_worker_load(text: str) -> WorkerLoad:
    """Read KV usage, waiting and running requests per data-parallel rank from Prometheus text,
    and the KV pool's size from `vllm:cache_config_info`.

    Raises ValueError for text that is not the Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    kv: dict[str, float] = {}
    waiting: dict[str, float] = {}
    running: dict[str, float] = {}
    pool_blocks = block_size = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name in (_KV_USAGE, _KV_USAGE_OLD):
                target = kv
            elif name == _WAITING:
                target = waiting
            elif name == _RUNNING:
                target = running
            else:
                if name == _CACHE_CONFIG:
                    pool_blocks, block_size = _pool_size(sample.labels)
                continue
            rank = next((sample.labels[k] for k in _RANK_LABELS if k in sample.labels), "0")
            value = float(sample.value)
            if math.isfinite(value):
                target[rank] = max(target.get(rank, 0.0), value)
    ranks = sorted(set(kv) | set(waiting))
    return WorkerLoad(ranks=tuple(
        RankLoad(kv_usage=kv.get(r, 0.0), waiting=int(waiting.get(r, 0.0)),
                 running=int(running[r]) if r in running else None)
        for r in ranks
    ), pool_blocks=pool_blocks, block_size=block_size)


def _pool_size(labels: Mapping[str, str]) -> tuple[int, int]:
    """(blocks, block size) from `vllm:cache_config_info` labels; (0, 0) unless both are
    positive integers (vLLM writes "None" before the cache is sized)."""
    try:
        blocks, size = int(labels.get("num_gpu_blocks", "")), int(labels.get("block_size", ""))
    except ValueError:
        return 0, 0
    return (blocks, size) if blocks > 0 and size > 0 else (0, 0)


def is_busy(load: WorkerLoad | None, thresholds: Thresholds, *, pending_prefill_tokens: int = 0,
            mean_prompt_tokens: float = 0.0, kv_blocks: int = 0,
            kv_blocks_at_scrape: int = 0) -> bool:
    """True when every rank of the worker exceeds a threshold.

    `pending_prefill_tokens` is the proxy's own count for the whole worker;
    it is shared by its ranks. With no scrape yet, only that count decides.
    `kv_blocks` are the KV blocks the proxy's requests fill on the worker now,
    `kv_blocks_at_scrape` the same when `load` was scraped: with the pool's size
    known, a rank's KV usage is the scraped one moved by the change since (shared
    by the ranks), and never below the proxy's own share.
    """
    ranks = load.ranks if load is not None and load.ranks else (RankLoad(),)
    per_rank_pending = pending_prefill_tokens / len(ranks)
    pool = load.pool_blocks * len(ranks) if load is not None else 0
    for rank in ranks:
        prefill = max(per_rank_pending, rank.waiting * mean_prompt_tokens)
        kv = rank.decode_load
        if pool:
            kv = max(kv + (kv_blocks - kv_blocks_at_scrape) / pool, kv_blocks / pool)
        busy = (kv > thresholds.active_decode_blocks_threshold
                or prefill > thresholds.active_prefill_tokens_threshold)
        if not busy:
            return False
    return True


def degradation_level(healthy_capacity: float) -> int:
    """0 to 4 from the ratio of healthy capacity (≥1, ≥0.75, ≥0.5, ≥0.25, below)."""
    for level, floor in enumerate((1.0, 0.75, 0.5, 0.25)):
        if healthy_capacity >= floor - 1e-9:
            return level
    return 4


def parse_priority(value: str | None) -> Priority:
    """The tier named by the `x-ftctl-priority` header; unknown or absent is standard."""
    if value is None:
        return "standard"
    name = value.strip().lower().replace("-", "_")
    for tier in PRIORITIES:
        if name == tier:
            return tier
    return "standard"


@dataclass(frozen=True)
class Decision:
    """Admit, or refuse with a reason (a label of `ftctl_proxy_rejected_requests_total`)."""

    admitted: bool
    reason: str = ""


ADMIT = Decision(admitted=True)


def decide(
    priority: Priority, level: int, busy: Iterable[bool], *, premium_when_busy: bool = True,
) -> Decision:
    """Admission of one request given the degradation level and each routable worker's state.

    `busy` has one flag per routable (healthy) worker; an empty iterable means
    no worker can serve at all. With `premium_when_busy`, premium requests are
    admitted (to queue in an engine) even when every worker is busy.
    """
    flags = list(busy)
    if not flags:
        return Decision(admitted=False, reason="no_healthy_worker")
    if priority in SHED_AT_LEVEL.get(level, SHED_AT_LEVEL[4]):
        return Decision(admitted=False, reason=f"degradation_level_{level}")
    if all(flags) and not (premium_when_busy and priority == "premium"):
        return Decision(admitted=False, reason="all_workers_busy")
    return ADMIT
