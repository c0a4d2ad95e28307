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

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    values,
)

__all__ = [
    "BACKPRESSURE",
    "CIRCUIT_BREAKER_STATE",
    "DEGRADATION_LEVEL",
    "DYNAMO_MIGRATION_DURATION",
    "DYNAMO_MIGRATION_LIMIT",
    "DYNAMO_MIGRATION_TOTAL",
    "FAULTS_INJECTED",
    "HEALTH_CHECK_DURATION",
    "LOCK_ACQUIRE_SECONDS",
    "LOCK_HOLDER",
    "METRIC_NAMES",
    "MIGRATION_DURATION",
    "MIGRATION_PROMPT_TOKENS",
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

# `<name>_created` series are prometheus_client's own (a Rust `prometheus` registry, as
# Dynamo's, has none); checked at each exposition, so this covers every registry here.
disable_created_metrics()  # type: ignore[no-untyped-call]


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
})
