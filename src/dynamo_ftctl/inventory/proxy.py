"""The `proxy:` section: the migrating front door's admission, retries and routing."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field

from dynamo_ftctl.structs import StrictStruct, check_host_port, check_http_url, doc

__all__ = ["BusyThresholds", "CacheAware", "ProxyConfig", "RetryBudget"]


class BusyThresholds(StrictStruct, frozen=True):
    """When a worker counts as busy for admission control."""

    active_decode_blocks_threshold: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.85
    active_prefill_tokens_threshold: Annotated[int, Meta(ge=0)] = 8192


class RetryBudget(StrictStruct, frozen=True):
    """How many retries the proxy lets run at once (Envoy's retry_budget, same defaults).

    A request that failed before its first token is retried elsewhere only while
    fewer retries are in flight than the larger of `budget_percent` of the
    requests in flight and `min_retry_concurrency`: a storm of failing requests
    cannot multiply the fleet's load. Continuations of a stream under way are not
    retries here (`migration_limit` bounds them per request).
    """

    budget_percent: Annotated[
        float, doc("Retries in flight allowed, as a percentage of the requests in flight.",
                    ge=0.0, le=100.0),
    ] = 20.0
    min_retry_concurrency: Annotated[
        int, doc("Retries in flight always allowed, whatever the traffic.", ge=0),
    ] = 3


class CacheAware(StrictStruct, frozen=True):
    """Cache-aware routing's settings (`proxy.routing: cache_aware`), sglang-router's and
    vllm-router's `cache_aware` policy's, with their defaults.

    A request goes to the worker holding the longest prefix of its prompt when that
    prefix is more than `cache_threshold` of it, else to the worker holding the
    fewest prefixes. When the fleet's load is out of balance, outstanding requests
    differing by more than `balance_abs_threshold` and the largest more than
    `balance_rel_threshold` times the smallest, the least loaded worker wins instead.
    """

    cache_threshold: Annotated[
        float, doc("Share of the prompt a worker's prefix must exceed to draw the request.",
                   ge=0.0, le=1.0),
    ] = 0.3
    balance_abs_threshold: Annotated[
        int, doc("Outstanding requests between the most and least loaded workers past "
                 "which (with the relative one) load wins over prefixes.", ge=0),
    ] = 64
    balance_rel_threshold: Annotated[
        float, doc("Ratio of the most to the least loaded worker's outstanding requests "
                   "past which (with the absolute one) load wins over prefixes.", ge=1.0),
    ] = 1.5
    max_entries: Annotated[
        int, doc("(prefix block, worker) pairs the index keeps, least recently used "
                 "evicted first (a block: 16 token ids or 64 characters; about 250 bytes "
                 "a pair).", ge=1),
    ] = 131072


class ProxyConfig(StrictStruct, frozen=True):
    """The migrating front door."""

    listen: str = "127.0.0.1:8000"
    migration_limit: Annotated[int, Meta(ge=0, le=100)] = 3
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    retry_budget: RetryBudget = field(default_factory=RetryBudget)
    stall_timeout_s: Annotated[
        float, doc("A worker that sends no token for this long has failed; a request "
                   "waits as long for the workers it could not connect to when no "
                   "other is left.", gt=0),
    ] = 15.0
    connect_timeout_s: Annotated[float, doc("TCP connect timeout per worker.", gt=0)] = 2.0
    whole_max_tokens: Annotated[
        int,
        doc("A client that does not stream and asks for at most this many tokens gets one "
             "whole upstream answer, not a stream (less CPU a request: docs/benchmarks.md): "
             "a failed one runs again from its start, a worker that keeps it waiting is "
             "asked a known-good request each stall_timeout_s. 0 (default): every "
             "upstream request streams, and a cut answer goes on from its last token.",
             ge=0),
    ] = 0
    health_url: Annotated[
        str | tuple[str, ...] | None,
        doc("Canary daemon base URL (GET /workers, POST /report), or a list of them: "
             "weights from the first that answers, failures reported to each; none "
             "answering, or none given: the proxy's own breakers."),
    ] = None
    health_token_env: Annotated[
        str,
        doc("Variable holding the daemon's bearer token for POST /report (unset: failures "
             "are not reported).", min_length=1),
    ] = "FTCTL_DAEMON_TOKEN"  # noqa: S105 - the variable's name, not a secret
    reject_status: Annotated[
        Literal[503, 529], doc("HTTP status when every worker is busy or a tier is shed."),
    ] = 503
    premium_when_busy: Annotated[
        Literal["admit", "shed"],
        doc("When every worker is busy: admit premium requests to queue at the least-loaded "
             "worker (standard and best_effort get the busy 503), or shed them too."),
    ] = "admit"
    retry_after_s: Annotated[int, doc("Retry-After (seconds) on a rejection.", ge=0)] = 1
    admin_token_env: Annotated[
        str, doc("Variable holding the bearer token of POST /busy_threshold."),
    ] = "FTCTL_ADMIN_TOKEN"  # noqa: S105 - the variable's name, not a secret
    scrape_interval_s: Annotated[
        float, doc("Seconds between scrapes of workers' /metrics and the daemon.", gt=0),
    ] = 1.0
    breaker_threshold: Annotated[
        int, doc("Consecutive failures, each confirmed by a failed known-good probe, that "
                 "open a worker's breaker (no daemon).", ge=1),
    ] = 3
    breaker_recovery_s: Annotated[
        float, doc("Seconds an open breaker waits before one trial request.", gt=0),
    ] = 60.0
    calibration: Annotated[
        str | None,
        doc("Calibration file (`ftctl migrate calibrate`, relative to the inventory): a "
             "live failed worker's KV is moved when it says a transfer beats re-prefill; "
             "none: always re-prefill."),
    ] = None
    max_connections: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        doc("Client connections at most; one more is answered 503 and closed. Default: "
             "what the open-file limit leaves room for, at most 4096."),
    ] = None
    max_buffered_mib: Annotated[
        int,
        doc("MiB of requests not yet answered (partial bodies included) held across all "
             "clients; the request that would go over is answered 503.", ge=1),
    ] = 256
    routing: Annotated[
        Literal["least_outstanding", "cache_aware"],
        doc("How a worker is chosen: the least outstanding requests (per routing weight), "
            "or where the prompt's longest prefix was served, so the engine's prefix "
            "cache hits, while the load stays in balance (`cache_aware:`)."),
    ] = "least_outstanding"
    cache_aware: CacheAware = field(default_factory=CacheAware)
    procs: Annotated[
        int,
        doc("Processes serving `listen` (SO_REUSEPORT), one view of the workers and one "
             "/metrics across them; each holds `max_connections` and `max_buffered_mib`.",
             ge=1, le=256),
    ] = 1
    _checked = (("listen", check_host_port), ("health_url", check_http_url))

    @property
    def daemon_urls(self) -> tuple[str, ...]:
        """The canary daemons' base URLs, in the order they are asked."""
        if self.health_url is None:
            return ()
        return (self.health_url,) if isinstance(self.health_url, str) else self.health_url
