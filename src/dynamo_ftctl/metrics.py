"""Every Prometheus metric ftctl exports, defined once (listed in docs/metrics.md;
docs/design.md, "Metrics").

ftctl's own series are named `ftctl_*`, so that on a Prometheus shared with
Dynamo they neither collide with Dynamo's `dynamo_*` series nor pass for them.
The exceptions mirror Dynamo's frontend migration series on purpose, with Dynamo's
exact names, types, labels and buckets (`dynamo_frontend_model_migration_total`,
`dynamo_frontend_model_migration_duration_seconds`,
`dynamo_frontend_model_migration_limit`, as Dynamo 1.6 defines them in
lib/runtime/src/metrics/prometheus_names.rs and lib/llm/src/http/service/metrics.rs),
so that Dynamo's dashboards count the proxy's migrations too. Dynamo exports no
`_created` series, so neither does ftctl: this module turns them off for the process.

Alert rules in deploy/prometheus/alerts.yml use only these names; a test keeps
the two in step, and docs/metrics.md lists the same set. Import this module only
in processes that serve `/metrics` (daemon, proxy, lock holder): prometheus_client
is not loaded at start-up.

Several processes, one exposition (`ftctl proxy --procs N`): where
`PROMETHEUS_MULTIPROC_DIR` is set (the proxy's parent makes the directory, sets it
for its children and removes it at the end), prometheus_client keeps every value in
a file of that directory, the metrics below are not registered anywhere, and
`REGISTRY` holds only a `MultiProcessCollector` that reads them all: /metrics from
any process shows counters and histograms summed over every process that ever ran
(a restarted child's counts stay), and each gauge by its `multiprocess_mode` (the
proxy's fleet gauges the same in every process: `livemax`; queued requests, each
process its own: `livesum`; gauges of single-process servers: `livemax`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    values,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

__all__ = [
    "BACKPRESSURE",
    "CIRCUIT_BREAKER_STATE",
    "DAEMON",
    "DEGRADATION_LEVEL",
    "DISCOVERED_WORKERS",
    "DISCOVERY_FAILURES",
    "DYNAMO_INFLIGHT",
    "DYNAMO_ITL",
    "DYNAMO_MIGRATION_DURATION",
    "DYNAMO_MIGRATION_LIMIT",
    "DYNAMO_MIGRATION_TOTAL",
    "DYNAMO_REQUESTS",
    "DYNAMO_REQUEST_DURATION",
    "DYNAMO_TTFT",
    "FAULTS_INJECTED",
    "HEALTH_CHECK_DURATION",
    "LOCK",
    "LOCK_ACQUIRE_SECONDS",
    "LOCK_HOLDER",
    "METRIC_NAMES",
    "MIGRATION_DURATION",
    "MIGRATION_PROMPT_TOKENS",
    "MIGRATION_TOTAL",
    "PROXY",
    "PROXY_DAEMON_UP",
    "QUERY_OF_DEATH",
    "QUEUED_REQUESTS",
    "REGISTRY",
    "RETRY_BUDGET_EXHAUSTED",
    "TASKS_REJECTED",
    "UNCONFIRMED_CHARGES",
    "WORKER_BUSY",
    "WORKER_STATUS",
    "XID",
    "XID_EVENTS",
    "observe_times",
    "registry_for",
]

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# `<name>_created` series are prometheus_client's own (a Rust `prometheus` registry, as
# Dynamo's, has none); checked at each exposition, so this covers every registry here.
disable_created_metrics()  # type: ignore[no-untyped-call]


def _registries() -> tuple[CollectorRegistry, CollectorRegistry | None]:
    """Every series this process records (for library callers and tests), and the
    registry the metrics are defined in."""
    if not os.environ.get(MULTIPROC_DIR_ENV):
        registry = CollectorRegistry(auto_describe=True)
        return registry, registry
    from prometheus_client import multiprocess

    # prometheus_client picks its value class when it is first imported: a process
    # that had imported it before the variable was set (a fork) is switched here.
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    exposed = CollectorRegistry()
    multiprocess.MultiProcessCollector(exposed)  # type: ignore[no-untyped-call]
    return exposed, None  # defined unregistered: the collector reads their files


# Every series recorded in this process (or, with `--procs N`, in all the proxy's).
# `/metrics` serves `registry_for(kind)`, which shows only that kind's families.
REGISTRY, _DEFINED = _registries()

# Probe latencies of interest span a fast loopback canary (ms) to a timed-out one (10 s+).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

HEALTH_CHECK_DURATION = Histogram(
    "ftctl_canary_probe_duration_seconds", "Wall time of one canary probe of a worker.",
    ["worker"], buckets=_LATENCY_BUCKETS, registry=_DEFINED,
)
WORKER_STATUS = Gauge(
    "ftctl_worker_state", "1 for the state a worker is in, 0 for the others.",
    ["worker", "state"], registry=_DEFINED,
    multiprocess_mode="livemax",
)
CIRCUIT_BREAKER_STATE = Gauge(
    "ftctl_circuit_breaker_state", "Per-worker breaker: 0 closed, 1 open, 2 half-open.",
    ["worker"], registry=_DEFINED,
    multiprocess_mode="livemax",
)
MIGRATION_TOTAL = Counter(
    "ftctl_migrations_total", "Requests continued on another worker after a failure.",
    ["source_group", "target_group", "method"], registry=_DEFINED,
)
# A continued stream's prompt (the client's prompt and the tokens generated before the
# cut), by how the new worker got its KV: "loaded" (its prefix cache or a KV connector's
# store: vLLM's usage.prompt_tokens_details.cached_tokens) or "recomputed". `method` is
# "kv" when any was loaded, else "reprefill". Counted when the worker's usage arrives.
MIGRATION_PROMPT_TOKENS = Counter(
    "ftctl_migration_prompt_tokens_total",
    "Prompt tokens of streams continued on another worker, loaded or recomputed.",
    ["method", "kind"], registry=_DEFINED,
)
# Dynamo's frontend counter, mirrored with its exact name and labels: `migration_type`
# is "new_request" (a failure before any token: `method="retry"`) or "ongoing_request"
# (a stream cut after tokens). Counted, as Dynamo does, when the proxy decides to go on
# elsewhere, not once the new stream answers.
DYNAMO_MIGRATION_TOTAL = Counter(
    "dynamo_frontend_model_migration_total",
    "Total number of request migrations due to worker unavailability",
    ["model", "migration_type"], registry=_DEFINED,
)
# Dynamo's histogram of a migration's time from the failure to its end: `outcome` is
# "success" (the stream went on elsewhere), "failure" (it ended without recovering) or
# "cancelled" (the client left first). Dynamo registers it with the `prometheus` crate's
# default buckets (its HistogramOpts sets none: 0.005 to 10 s, the same as
# prometheus_client's default).
DYNAMO_MIGRATION_DURATION = Histogram(
    "dynamo_frontend_model_migration_duration_seconds",
    "Time from detecting a migratable failure until recovery, terminal failure, or "
    "cancellation",
    ["model", "migration_type", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=_DEFINED,
)
# Dynamo's per-model gauge of the migrations a request may make (its --migration-limit);
# the proxy's `migration_limit`, set for each model its workers serve.
DYNAMO_MIGRATION_LIMIT = Gauge(
    "dynamo_frontend_model_migration_limit",
    "Maximum number of request migrations allowed for the model",
    ["model"], registry=_DEFINED,
    multiprocess_mode="livemax",
)
MIGRATION_DURATION = Histogram(
    "ftctl_migration_duration_seconds",
    "Time from a detected stream failure to the first token from the new worker.",
    buckets=_LATENCY_BUCKETS, registry=_DEFINED,
)
DEGRADATION_LEVEL = Gauge(
    "ftctl_proxy_degradation_level", "0 (full capacity) to 4 (below a quarter healthy).",
    registry=_DEFINED,
    multiprocess_mode="livemax",
)
TASKS_REJECTED = Counter(
    "ftctl_proxy_rejected_requests_total", "Requests refused by admission control.",
    ["reason", "priority"], registry=_DEFINED,
)
QUEUED_REQUESTS = Gauge(
    "ftctl_proxy_queued_requests", "Requests in the proxy with no first token yet.",
    registry=_DEFINED,
    multiprocess_mode="livesum",
)
QUERY_OF_DEATH = Counter(
    "ftctl_proxy_query_of_death_total",
    "Requests that failed the same way on two workers, or were remembered for ending "
    "other requests' streams, and were not tried on more.",
    registry=_DEFINED,
)
UNCONFIRMED_CHARGES = Counter(
    "ftctl_proxy_unconfirmed_charges_total",
    "Failures charged to a worker that then answered the known-good probe (no breaker "
    "moved, nothing reported).",
    ["worker"], registry=_DEFINED,
)
BACKPRESSURE = Counter(
    "ftctl_proxy_backpressure_total",
    "Answers 429, 503 or 529 from a worker: spared for its Retry-After, nothing charged.",
    ["worker"], registry=_DEFINED,
)
RETRY_BUDGET_EXHAUSTED = Counter(
    "ftctl_proxy_retry_budget_exhausted_total",
    "Failed requests not retried because the proxy's retry budget was spent.",
    registry=_DEFINED,
)
WORKER_BUSY = Gauge(
    "ftctl_worker_busy", "1 while the proxy counts a worker busy (admission), else 0.",
    ["worker"], registry=_DEFINED,
    multiprocess_mode="livemax",
)
# Dynamo's frontend request series, mirrored with Dynamo 1.6's exact names, types,
# labels, help texts and buckets (read from a running ai-dynamo-runtime 1.6.1 frontend's
# /metrics; its buckets are `generate_log_buckets(min, max, count)`: 0, then log-spaced
# values rounded to two significant figures). `model` is the request's model, or
# "unknown_model" for one no worker serves (as Dynamo's frontend labels it). Counted once
# per request, at its end (`proxy/tally.py`).
DYNAMO_REQUESTS = Counter(
    "dynamo_frontend_requests_total", "Total number of LLM requests processed",
    ["model", "endpoint", "request_type", "status", "error_type"], registry=_DEFINED,
)
DYNAMO_INFLIGHT = Gauge(
    "dynamo_frontend_inflight_requests", "Number of inflight requests",
    ["model"], registry=_DEFINED,
    multiprocess_mode="livesum",
)
# Dynamo's defaults: (1, 512, 10), (0.001, 480, 18), (0.001, 2, 13) for min, max, count.
DYNAMO_REQUEST_DURATION = Histogram(
    "dynamo_frontend_request_duration_seconds", "Duration of LLM requests",
    ["model"], buckets=(0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 130.0, 260.0, 510.0),
    registry=_DEFINED,
)
DYNAMO_TTFT = Histogram(
    "dynamo_frontend_time_to_first_token_seconds", "Time to first token in seconds",
    ["model"], buckets=(0.0, 0.0022, 0.0047, 0.01, 0.022, 0.047, 0.1, 0.22, 0.47, 1.0, 2.2,
                        4.7, 10.0, 22.0, 48.0, 100.0, 220.0, 480.0),
    registry=_DEFINED,
)
DYNAMO_ITL = Histogram(
    "dynamo_frontend_inter_token_latency_seconds", "Inter-token latency in seconds",
    ["model"], buckets=(0.0, 0.0019, 0.0035, 0.0067, 0.013, 0.024, 0.045, 0.084, 0.16, 0.3,
                        0.56, 1.1, 2.0),
    registry=_DEFINED,
)
PROXY_DAEMON_UP = Gauge(
    "ftctl_proxy_daemon_up",
    "1 while the proxy's last read of its canary daemon's /workers succeeded, else 0.",
    ["daemon"], registry=_DEFINED,
    multiprocess_mode="livemin",
)
LOCK_HOLDER = Gauge(
    "ftctl_lock_holder", "1 while this engine holds the failover lock.",
    ["lock", "engine_id"], registry=_DEFINED,
    multiprocess_mode="livemax",
)
LOCK_ACQUIRE_SECONDS = Histogram(
    "ftctl_lock_acquire_seconds", "Time spent waiting for the failover lock.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.1, 1.0, 10.0, 60.0, 600.0), registry=_DEFINED,
)
FAULTS_INJECTED = Counter(
    "ftctl_faults_injected_total", "Faults injected by ftctl inject or a drill.",
    ["fault", "worker"], registry=_DEFINED,
)
XID_EVENTS = Counter(
    "ftctl_xid_events_total", "GPU Xid events seen by the watcher.", ["gpu", "xid"],
    registry=_DEFINED,
)

DISCOVERY_FAILURES = Counter(
    "ftctl_discovery_failures_total",
    "DNS discovery rounds whose answer was not taken as it came: reason timeout, servfail, "
    "error (the workers stay), empty (nothing found, not yet believed) or capped (past "
    "max_workers).",
    ["source", "reason"], registry=_DEFINED,
)
DISCOVERED_WORKERS = Gauge(
    "ftctl_discovery_workers", "Workers a DNS discovery entry gives now.",
    ["source"], registry=_DEFINED,
    multiprocess_mode="livemax",
)


# What each kind of process serves on /metrics (beside `process_*` and `python_info`).
PROXY = "proxy"
DAEMON = "daemon"
LOCK = "lock"
XID = "xid"
_FAMILIES: dict[str, tuple[MetricWrapperBase, ...]] = {
    PROXY: (CIRCUIT_BREAKER_STATE, MIGRATION_TOTAL, DYNAMO_MIGRATION_TOTAL,
            DYNAMO_MIGRATION_DURATION, DYNAMO_MIGRATION_LIMIT, MIGRATION_DURATION,
            DEGRADATION_LEVEL, TASKS_REJECTED, QUEUED_REQUESTS, QUERY_OF_DEATH,
            UNCONFIRMED_CHARGES, BACKPRESSURE, RETRY_BUDGET_EXHAUSTED, WORKER_BUSY,
            DYNAMO_REQUESTS, DYNAMO_INFLIGHT, DYNAMO_REQUEST_DURATION, DYNAMO_TTFT, DYNAMO_ITL,
            PROXY_DAEMON_UP),
    DAEMON: (HEALTH_CHECK_DURATION, WORKER_STATUS, CIRCUIT_BREAKER_STATE),
    LOCK: (LOCK_HOLDER, LOCK_ACQUIRE_SECONDS),
    XID: (XID_EVENTS,),
}
# Families any kind shows once it has recorded a sample (a drill injecting faults from a
# process that serves /metrics; a proxy or daemon following DNS discovery; a proxy whose
# workers report the prompt tokens they loaded), and never as
# an empty header.
_IF_RECORDED: tuple[MetricWrapperBase, ...] = (FAULTS_INJECTED, DISCOVERY_FAILURES,
                                               DISCOVERED_WORKERS, MIGRATION_PROMPT_TOKENS)


def _family_names(collectors: tuple[MetricWrapperBase, ...]) -> frozenset[str]:
    return frozenset(family.name for c in collectors for family in c.describe())


class _Only:
    """The families of `REGISTRY` one kind of process serves (a custom collector)."""

    def __init__(self, kind: str) -> None:
        self.names = _family_names(_FAMILIES[kind])
        self.if_recorded = _family_names(_IF_RECORDED)

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name in self.names or (family.name in self.if_recorded
                                             and family.samples):
                yield family


class _ProcessesCollector:
    """`process_*` of every live process of `ftctl proxy --procs N` (its children, whose
    live gauge files are in the multiprocess directory; the parent, which only waits on
    signals, is left out): CPU, memory and descriptors summed, the earliest start time,
    the largest descriptor limit. A child that ends takes its CPU seconds with it: the
    counter drops, which `rate()` reads as a reset."""

    def collect(self) -> Iterator[Metric]:
        from prometheus_client import ProcessCollector

        directory = os.environ.get(MULTIPROC_DIR_ENV, "")
        pids = {os.getpid()}
        with contextlib.suppress(OSError):
            for path in Path(directory).glob("gauge_live*_*.db"):
                with contextlib.suppress(ValueError):
                    pids.add(int(path.stem.rsplit("_", 1)[1]))
        merged: dict[str, Metric] = {}
        for pid in sorted(pids):
            # The collector reads /proc/<pid>; a pid gone meanwhile yields nothing.
            for family in ProcessCollector(pid=functools.partial(int, pid),
                                           registry=None).collect():
                known = merged.setdefault(family.name, family)
                if known is family:
                    continue
                value, other = known.samples[0].value, family.samples[0].value
                combined = (min(value, other) if family.name == "process_start_time_seconds"
                            else max(value, other) if family.name == "process_max_fds"
                            else value + other)
                known.samples[0] = known.samples[0]._replace(value=combined)
        yield from merged.values()


_SERVED: dict[str, CollectorRegistry] = {}


def registry_for(kind: str) -> CollectorRegistry:
    """The registry a process of `kind` (`PROXY`, `DAEMON`, `LOCK`, `XID`) serves on
    /metrics: its own families, `process_*` and `python_info`, and nothing else (a
    daemon's page has no `ftctl_proxy_*`). The same object for every call."""
    served = _SERVED.get(kind)
    if served is None:
        from prometheus_client import PlatformCollector, ProcessCollector

        served = CollectorRegistry(auto_describe=True)
        served.register(_Only(kind))
        if _DEFINED is None:
            served.register(_ProcessesCollector())
        else:
            ProcessCollector(registry=served)
        PlatformCollector(registry=served)
        _SERVED[kind] = served
    return served


METRIC_NAMES: frozenset[str] = frozenset({
    "ftctl_canary_probe_duration_seconds",
    "ftctl_worker_state",
    "ftctl_circuit_breaker_state",
    "ftctl_migrations_total",
    "dynamo_frontend_model_migration_total",
    "dynamo_frontend_model_migration_duration_seconds",
    "dynamo_frontend_model_migration_limit",
    "ftctl_migration_duration_seconds",
    "ftctl_migration_prompt_tokens_total",
    "ftctl_proxy_degradation_level",
    "ftctl_proxy_rejected_requests_total",
    "ftctl_proxy_queued_requests",
    "ftctl_proxy_query_of_death_total",
    "ftctl_proxy_unconfirmed_charges_total",
    "ftctl_proxy_backpressure_total",
    "ftctl_proxy_retry_budget_exhausted_total",
    "ftctl_worker_busy",
    "ftctl_lock_holder",
    "ftctl_lock_acquire_seconds",
    "ftctl_faults_injected_total",
    "ftctl_xid_events_total",
    "dynamo_frontend_requests_total",
    "dynamo_frontend_inflight_requests",
    "dynamo_frontend_request_duration_seconds",
    "dynamo_frontend_time_to_first_token_seconds",
    "dynamo_frontend_inter_token_latency_seconds",
    "ftctl_proxy_daemon_up",
    "ftctl_discovery_failures_total",
    "ftctl_discovery_workers",
})


def observe_times(histogram: Histogram, value: float, times: int) -> None:
    """`histogram.observe(value)` `times` times over, in one step (`times` >= 1).

    prometheus_client has no weighted observation; this adds to the same bucket and
    sum `observe` does (its `_sum`, `_buckets`, `_upper_bounds`, as in 0.20 to 0.26;
    a test checks it against `observe`).
    """
    histogram._sum.inc(value * times)
    for i, bound in enumerate(histogram._upper_bounds):
        if value <= bound:
            histogram._buckets[i].inc(times)
            return
