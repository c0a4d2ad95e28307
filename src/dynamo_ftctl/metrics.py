"""Every Prometheus metric ftctl exports, defined once (listed in docs/metrics.md;
docs/design.md, "Metrics").

ftctl's own series are named `ftctl_*`, so that on a Prometheus shared with
Dynamo they neither collide with Dynamo's `dynamo_*` series nor pass for them.
The one exception mirrors a Dynamo series on purpose, with Dynamo's exact name
and labels (`dynamo_frontend_model_migration_total{model, migration_type}`, from
ai-dynamo/dynamo lib/runtime/src/metrics/prometheus_names.rs), so that Dynamo's
dashboards count the proxy's migrations too.

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

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

__all__ = [
    "BACKPRESSURE",
    "CIRCUIT_BREAKER_STATE",
    "DEGRADATION_LEVEL",
    "DISCOVERED_WORKERS",
    "DISCOVERY_FAILURES",
    "DYNAMO_MIGRATION_TOTAL",
    "FAULTS_INJECTED",
    "HEALTH_CHECK_DURATION",
    "LOCK_ACQUIRE_SECONDS",
    "LOCK_HOLDER",
    "METRIC_NAMES",
    "MIGRATION_DURATION",
    "MIGRATION_TOTAL",
    "QUERY_OF_DEATH",
    "QUEUED_REQUESTS",
    "REGISTRY",
    "RETRY_BUDGET_EXHAUSTED",
    "TASKS_REJECTED",
    "UNCONFIRMED_CHARGES",
    "WORKER_BUSY",
    "WORKER_STATUS",
    "XID_EVENTS",
]

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _registries() -> tuple[CollectorRegistry, CollectorRegistry | None]:
    """The registry servers expose on /metrics, and the one the metrics are defined in."""
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


# One registry for the whole process (or all the proxy's); servers expose it on /metrics.
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
# Dynamo's frontend counter, mirrored with its exact name and labels: `migration_type`
# is "new_request" (a failure before any token: `method="retry"`) or "ongoing_request"
# (a stream cut after tokens). Counted, as Dynamo does, when the proxy decides to go on
# elsewhere, not once the new stream answers.
DYNAMO_MIGRATION_TOTAL = Counter(
    "dynamo_frontend_model_migration_total",
    "Total number of request migrations due to worker unavailability",
    ["model", "migration_type"], registry=_DEFINED,
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

METRIC_NAMES: frozenset[str] = frozenset({
    "ftctl_canary_probe_duration_seconds",
    "ftctl_worker_state",
    "ftctl_circuit_breaker_state",
    "ftctl_migrations_total",
    "dynamo_frontend_model_migration_total",
    "ftctl_migration_duration_seconds",
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
    "ftctl_discovery_failures_total",
    "ftctl_discovery_workers",
})
