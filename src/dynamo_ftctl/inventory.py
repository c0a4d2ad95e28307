"""The cluster inventory: frozen msgspec structs and a loader whose errors name file:line: key.

One YAML file describes the cluster; every command reads it through
`load_inventory`. Unknown keys, duplicate worker names, bad URLs, faults that
are not in the fault catalog and references to undeclared groups are errors.
Every error is one line: `ftctl.yaml:12: workers[2].url: not a valid http(s) URL`.

This module runs in Kubernetes exec probes and engine entrypoints, so it must
start fast: the structs are `structs.StrictStruct`s (msgspec) and the YAML is
read by `documents` (bounded, with the line of every key). The names that moved
there (`StrictStruct`, `KeyedValueError`, `convert_struct`, `format_key_path`,
`load_yaml_document`) are re-exported here for the callers that import them
from this module.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Meta, field

from dynamo_ftctl.documents import (
    MAX_DOCUMENT_BYTES,
    Located,
    format_key_path,
    load_yaml_document,
    parse_yaml,
)
from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.faultnames import check_fault
from dynamo_ftctl.structs import (
    KeyedValueError,
    StrictStruct,
    check_host_port,
    check_http_url,
    check_name,
    close_matches,
    convert_struct,
    doc,
    load_struct,
)

__all__ = [
    "MAX_YAML_BYTES",
    "AdminEndpoint",
    "BusyThresholds",
    "CacheAware",
    "CanaryConfig",
    "DnsWorkers",
    "EtcdConfig",
    "Group",
    "InjectConfig",
    "Inventory",
    "KeyedValueError",
    "Launch",
    "LockConfig",
    "ProcessRef",
    "ProxyConfig",
    "RetryBudget",
    "SimLaunch",
    "StrictStruct",
    "TransitionAction",
    "Worker",
    "convert_struct",
    "format_key_path",
    "inventory_json_schema",
    "load_inventory",
    "load_yaml_document",
    "parse_inventory",
]

# The limit of every YAML document ftctl reads (see `documents`).
MAX_YAML_BYTES = MAX_DOCUMENT_BYTES


class AdminEndpoint(StrictStruct, frozen=True):
    """A worker's admin API (fault endpoint, KV export/import, sleep/wake)."""

    url: Annotated[str | None, doc("Admin base URL; default: the worker URL.")] = None
    token_env: Annotated[str, doc("Environment variable that holds the bearer token.")] = (
        "FTCTL_ADMIN_TOKEN"  # noqa: S105 - the variable's name, not a secret
    )
    _checked = (("url", check_http_url),)


class ProcessRef(StrictStruct, frozen=True):
    """How to find a worker's process for signal faults."""

    pid_file: Annotated[Path | None, doc("File holding the engine's pid.")] = None
    pid: Annotated[int, doc("A fixed pid (tests, static hosts).", gt=0)] | None = None
    group: Annotated[
        bool,
        doc("Signal the pid's whole process group (it must lead one): an engine of several "
             "processes, e.g. vLLM's API server, engine core and workers, dies or stops as "
             "one."),
    ] = False


class InjectConfig(StrictStruct, frozen=True):
    """How `ftctl inject` reaches a worker: which injectors, and where they write."""

    injectors: Annotated[
        tuple[Literal["signal", "http", "kmsg", "dcgm", "net"], ...],
        doc("Injectors allowed on this worker, in preference order."),
    ] = ("signal", "http")
    kmsg_path: Annotated[
        Path, doc("Kernel log the kmsg injector writes Xid lines to (default /dev/kmsg)."),
    ] = field(default_factory=lambda: Path("/dev/kmsg"))
    pci_bus_id: Annotated[
        str, doc("PCI bus id named in injected Xid lines (no GPU: a stand-in)."),
    ] = "0000:3b:00"
    netproxy: Annotated[
        str | None, doc("Control URL of the TCP fault proxy in front of this worker."),
    ] = None
    netproxy_token_env: Annotated[
        str, doc("Variable holding the fault proxy's control token (bearer).", min_length=1),
    ] = "FTCTL_NETPROXY_TOKEN"  # noqa: S105 - the variable's name, not a secret
    _checked = (("netproxy", check_http_url),)


class SimLaunch(StrictStruct, frozen=True):
    """Start this worker as an `ftctl sim` engine with `--local` / `ftctl sim cluster`."""

    seed: Annotated[int, doc("Weight seed: same seed, same model.", ge=0)] = 0
    model_config_name: Annotated[str, doc("Engine config preset or YAML path.")] = field(
        default="ftctl-sim-tiny", name="model_config",
    )
    warmup_s: Annotated[
        float, doc("Extra delay of the first request (`--warmup-s`; default 1.0).", ge=0),
    ] | None = None
    args: Annotated[tuple[str, ...], doc("Extra `ftctl sim serve` flags.")] = ()


_PLACEHOLDER = re.compile(r"(?<!\$)\{([^{}]*)\}")  # `${VAR}` is the environment's
COMMAND_PLACEHOLDERS = ("host", "port", "model")


def _check_placeholders(value: str) -> str:
    for name in _PLACEHOLDER.findall(value):
        if name not in COMMAND_PLACEHOLDERS:
            msg = (f"unknown placeholder {{{name}}} in {value!r} (known: "
                   + ", ".join(f"{{{n}}}" for n in COMMAND_PLACEHOLDERS) + ")")
            raise ValueError(msg)
    return value


class Launch(StrictStruct, frozen=True):
    """Local launch recipe (only for workers started by ftctl itself).

    `sim`: an `ftctl sim` engine. `command`: any OpenAI-compatible server (vLLM…),
    started by `ftctl drill --local` in a process group of its own: `{host}`, `{port}`
    and `{model}` in it become the loopback address and free port the drill picks and
    the worker's `model`; `${VAR}` is taken from the environment when the drill starts
    (an unset one is an error naming the key).
    """

    sim: SimLaunch | None = None
    command: Annotated[
        tuple[str, ...],
        doc("argv of an OpenAI server, with {host}, {port}, {model} and ${VAR}.",
             min_length=1),
    ] | None = None
    env: Annotated[dict[str, str], doc("command: extra environment (values take ${VAR}).")] = (
        field(default_factory=dict)
    )
    health_path: Annotated[str, doc("command: path that answers 200 once it serves.")] = (
        "/health"
    )
    start_timeout_s: Annotated[
        float, doc("command: seconds to wait for health.", gt=0, le=3600),
    ] = 300.0
    warmup: Annotated[
        bool, doc("command: one short completion once healthy (vLLM's first is slow)."),
    ] = True
    _checked = (("command", _check_placeholders),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sim is not None and self.command is not None:
            raise KeyedValueError(("command",), "give sim or command, not both")
        if not self.health_path.startswith("/"):
            raise KeyedValueError(("health_path",), f"must start with '/': {self.health_path!r}")


class Worker(StrictStruct, frozen=True):
    """One inference engine endpoint (OpenAI-compatible)."""

    name: str
    url: Annotated[str, doc("OpenAI-compatible base URL, e.g. http://10.0.0.3:8000.")]
    model: Annotated[str, doc("Served model id.", min_length=1)]
    node: Annotated[str, doc("Host the engine runs on.", min_length=1)] = "localhost"
    gpus: Annotated[tuple[Annotated[int, Meta(ge=0)], ...], doc("GPU indices on the node.")] = ()
    group: Annotated[str | None, doc("TP/PP group: fails and migrates as a unit.")] = None
    admin: AdminEndpoint | None = None
    process: ProcessRef | None = None
    faults: Annotated[tuple[str, ...], doc("Faults `ftctl inject` may use here.")] = ()
    protected: Annotated[bool, doc("Refuse every fault injection on this worker.")] = False
    inject: Annotated[InjectConfig, doc("Injectors `ftctl inject` may use on this worker.")] = (
        field(default_factory=InjectConfig)
    )
    launch: Launch | None = None
    tokenizer: Annotated[Path | None, doc(
        "The served model's tokenizer: a directory holding tokenizer.json, or that file. "
        "The proxy counts the text of a worker that returns no token ids with it, where "
        "the worker's usage chunk and /tokenize give no count, and continues a chat "
        "with the model's chat template from that directory where the server cannot "
        "continue a message (needs the tokenizer extra)."),
    ] = None
    _checked = (
        ("name", check_name), ("url", check_http_url), ("group", check_name),
        ("faults", check_fault),
    )

    @property
    def admin_url(self) -> str:
        """Base URL of the admin API (the worker URL unless overridden)."""
        return self.admin.url if self.admin and self.admin.url else self.url


_DNS_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def check_dns_name(value: str) -> str:
    """A DNS name (labels of letters, digits, '-' and '_', at most 253 characters); the
    trailing dot is implied and dropped. ValueError otherwise."""
    name = value[:-1] if value.endswith(".") else value
    if not name or len(name) > 253 or not all(_DNS_LABEL.match(p) for p in name.split(".")):
        msg = f"not a DNS name: {value!r}"
        raise ValueError(msg)
    return name


class DnsWorkers(StrictStruct, frozen=True):
    """Workers found in DNS (a Kubernetes headless Service): each address is a worker.

    The name is resolved every `resolve_every_s` (A and AAAA, or SRV); every address
    becomes a worker named `<name>-<address>-<port>`. A failed resolution keeps the
    workers last found; see `dynamo_ftctl.discovery`.
    """

    name: Annotated[str, doc("Prefix of the workers' names: <name>-<address>-<port>.")]
    dns: Annotated[
        str, doc("Fully qualified name to resolve, e.g. vllm.ns.svc.cluster.local (no "
                 "search domains are tried)."),
    ]
    model: Annotated[str, doc("Served model id of every worker found.", min_length=1)]
    port: Annotated[int, doc("Port of every address (not with srv).", ge=1, le=65535)] = 8000
    scheme: Annotated[Literal["http", "https"], doc("URL scheme of the workers.")] = "http"
    srv: Annotated[
        bool,
        doc("Resolve SRV records instead (`_http._tcp.<dns>` unless `dns` starts with '_'): "
             "their targets' addresses and their ports."),
    ] = False
    resolve_every_s: Annotated[float, doc("Seconds between resolutions.", ge=0.05, le=3600)] = 5.0
    timeout_s: Annotated[float, doc("Seconds one resolution may take.", gt=0, le=60)] = 2.0
    resolver: Annotated[
        str | None,
        doc("DNS server HOST:PORT to ask (an IP address); default: /etc/resolv.conf's."),
    ] = None
    max_workers: Annotated[
        int, doc("Addresses taken from one answer at most (the lowest, sorted); the rest are "
                 "logged and left out.", ge=1, le=1024),
    ] = 64
    empty_after_rounds: Annotated[
        int, doc("Resolutions in a row that must find nothing (NXDOMAIN or no records) before "
                 "the workers found leave.", ge=1, le=1000),
    ] = 3
    _checked = (("name", check_name), ("dns", check_dns_name), ("resolver", check_host_port))

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.name) > 24:
            raise KeyedValueError(("name",), f"at most 24 characters (it prefixes worker "
                                  f"names): {self.name!r}")
        if self.resolver is not None:
            import ipaddress

            host = self.resolver.rpartition(":")[0].strip("[]")
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise KeyedValueError(("resolver",), f"the resolver must be an IP address "
                                      f"and port: {self.resolver!r}") from None


class Group(StrictStruct, frozen=True):
    """A tensor/pipeline-parallel group of workers that fail and migrate together."""

    name: str
    tp: Annotated[int, doc("Tensor-parallel degree.", ge=1)] = 1
    pp: Annotated[int, doc("Pipeline-parallel degree.", ge=1)] = 1
    _checked = (("name", check_name),)


HealthStateName = Literal["healthy", "suspicious", "unhealthy", "draining", "dead"]


class TransitionAction(StrictStruct, frozen=True):
    """What the canary daemon does when a worker enters one of `on` (HTTP call or command)."""

    on: Annotated[
        tuple[HealthStateName, ...], doc("States whose entry triggers the action.", min_length=1),
    ] = ("unhealthy",)
    http: Annotated[
        str | None, doc("POST {worker, state, previous, reason} as JSON to this URL."),
    ] = None
    token_env: Annotated[str | None, doc("Variable holding a bearer token for the HTTP call.")] = (
        None
    )
    command: Annotated[
        tuple[str, ...],
        doc("argv to run with FTCTL_WORKER, FTCTL_STATE, FTCTL_PREVIOUS_STATE set.", min_length=1),
    ] | None = None
    timeout_s: Annotated[float, doc("Give up on the action after this long.", gt=0)] = 10.0
    _checked = (("http", check_http_url),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.http is None) == (self.command is None):
            raise KeyedValueError(("http",), "give exactly one of 'http' or 'command'")


class CanaryConfig(StrictStruct, frozen=True):
    """Canary probing and the health state machine."""

    interval_s: Annotated[float, doc("Seconds between probes of a worker.", gt=0)] = 30.0
    timeout_s: Annotated[float, doc("Per-request timeout.", gt=0)] = 10.0
    max_retries: Annotated[int, doc("Retries on transient errors only.", ge=0, le=10)] = 2
    set: Annotated[str | None, doc("Canary set YAML, relative to the inventory.")] = None
    latency_spike_factor: Annotated[
        float, doc("A probe slower than this times the EMA baseline is a latency spike.", gt=1.0),
    ] = 3.0
    ema_alpha: Annotated[
        float, doc("Weight of the newest latency in the EMA baseline.", gt=0.0, le=1.0),
    ] = 0.1
    failure_threshold: Annotated[
        int, doc("Consecutive failures that make a worker UNHEALTHY.", ge=1, le=100),
    ] = 3
    recovery_s: Annotated[
        float, doc("Seconds an open breaker waits before one half-open trial.", gt=0),
    ] = 60.0
    dead_after_trials: Annotated[
        int,
        doc("Failed half-open trials before DEAD (the first one moves to DRAINING).", ge=1,
             le=100),
    ] = 2
    parallel_prompts: Annotated[
        bool,
        doc("Send a set's prompts at once: a probe's latency is its slowest answer (false: "
             "one after another, its latency is their sum)."),
    ] = True
    concurrency: Annotated[
        int, doc("Probes in flight at once in the daemon.", ge=1, le=10000),
    ] = 256
    listen: Annotated[str, doc("Daemon HTTP address (/workers, /report, /metrics).")] = (
        "127.0.0.1:8090"
    )
    token_env: Annotated[
        str,
        doc("Variable holding the bearer token of POST /report (unset: reports refused, "
             "403); `ftctl gpu --report` sends it too.", min_length=1),
    ] = "FTCTL_DAEMON_TOKEN"  # noqa: S105 - the variable's name, not a secret
    report_rate_per_s: Annotated[
        float, doc("Reports a second one client address may send (beyond: 429).", gt=0),
    ] = 10.0
    report_burst: Annotated[
        int, doc("Reports one client address may send at once.", ge=1, le=10000),
    ] = 20
    state_file: Annotated[
        str | None, doc("Latency baseline file (default: $XDG_STATE_HOME/ftctl/canary.json)."),
    ] = None
    transition_log: Annotated[
        str | None, doc("Append every state transition here as a JSON line."),
    ] = None
    actions: Annotated[
        tuple[TransitionAction, ...], doc("HTTP calls or commands run on state transitions."),
    ] = ()
    acting_lock: Annotated[
        str | None,
        doc("Lock file on a volume several daemons share: only its holder runs the actions, "
             "the others probe and serve /workers and take over when it dies (unset: this "
             "daemon acts alone)."),
    ] = None
    _checked = (("listen", check_host_port),)


class EtcdConfig(StrictStruct, frozen=True):
    """etcd lock backend (engines on different nodes)."""

    endpoints: Annotated[tuple[str, ...], Meta(min_length=1)] = ("http://127.0.0.1:2379",)
    key: Annotated[str, Meta(min_length=1)] = "/ftctl/locks/failover"
    ttl_s: Annotated[float, Meta(ge=1.0, le=3600.0)] = 5.0
    _checked = (("endpoints", check_http_url),)


class LockConfig(StrictStruct, frozen=True):
    """The failover lock shared by a primary and its shadow."""

    backend: Literal["flock", "etcd"] = "flock"
    path: Annotated[Path | None, doc("flock file (default: $FAILOVER_LOCK_PATH).")] = None
    etcd: EtcdConfig = field(default_factory=EtcdConfig)


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
        float, doc("A worker that sends no token for this long has failed.", gt=0),
    ] = 15.0
    connect_timeout_s: Annotated[float, doc("TCP connect timeout per worker.", gt=0)] = 2.0
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


class Inventory(StrictStruct, frozen=True, dict=True):
    """A whole cluster: workers, their groups and the settings of every service."""

    cluster: str
    workers: tuple[Worker, ...] = ()
    discovery: Annotated[
        tuple[DnsWorkers, ...],
        doc("Workers found in DNS (the proxy and the canary daemon follow them)."),
    ] = ()
    groups: tuple[Group, ...] = ()
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    lock: LockConfig = field(default_factory=LockConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    _checked = (("cluster", check_name),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.workers and not self.discovery:
            raise KeyedValueError(("workers",), "give at least one worker, or a discovery entry")
        if self.discovery and self.proxy.procs > 1:
            raise KeyedValueError(("proxy", "procs"), "discovered workers come and go; with "
                                  "procs above 1 the workers are fixed (one proxy process)")
        sources: set[str] = set()
        for index, source in enumerate(self.discovery):
            if source.name in sources:
                raise KeyedValueError(("discovery", index, "name"),
                                      f"duplicate discovery name {source.name!r}")
            sources.add(source.name)
        seen: dict[str, int] = {}
        for index, worker in enumerate(self.workers):
            if worker.name in seen:
                raise KeyedValueError(
                    ("workers", index, "name"),
                    f"duplicate worker name {worker.name!r} "
                    f"(first at workers[{seen[worker.name]}])",
                )
            seen[worker.name] = index
        group_names: dict[str, int] = {}
        for index, group in enumerate(self.groups):
            if group.name in group_names:
                raise KeyedValueError(
                    ("groups", index, "name"), f"duplicate group name {group.name!r}",
                )
            group_names[group.name] = index
        for index, worker in enumerate(self.workers):
            if worker.group is not None and worker.group not in group_names:
                declared = ", ".join(sorted(group_names)) or "none declared"
                raise KeyedValueError(
                    ("workers", index, "group"),
                    f"unknown group {worker.group!r} (groups: {declared})",
                )

    @property
    def source(self) -> Path | None:
        """The file this inventory was loaded from, if any."""
        source: Path | None = self.__dict__.get("_source")
        return source

    def worker(self, name: str) -> Worker:
        """The worker called `name`; an `InvalidInput` naming close matches otherwise."""
        for worker in self.workers:
            if worker.name == name:
                return worker
        names = [w.name for w in self.workers]
        close = close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; workers: {', '.join(names)}"
        where = f"{self.source}: " if self.source else ""
        msg = f"{where}no worker named {name!r}{hint}"
        raise InvalidInput(msg)

    def group_of(self, worker: Worker) -> str:
        """The failure domain of a worker: its group, else the worker itself."""
        return worker.group or worker.name

    def resolve(self, relative: str | Path) -> Path:
        """A path from the inventory, resolved against the inventory file's folder."""
        path = Path(relative).expanduser()
        source = self.source
        if path.is_absolute() or source is None:
            return path
        return source.parent / path


def parse_inventory(text: str, path: Path | str = "<inventory>") -> Inventory:
    """Validate inventory YAML text; errors name `path`, line and key."""
    path = Path(path)
    located = parse_yaml(text, path)
    if located.data is None:
        msg = "empty document, expected a mapping with 'cluster' and 'workers'"
        raise InventoryError(msg, path=path, line=1)
    if not isinstance(located.data, dict):
        msg = f"expected a mapping at the top level, got {type(located.data).__name__}"
        raise InventoryError(msg, path=path, line=located.lines.get((), 1))
    return _validate(located, path)


def _validate(located: Located, path: Path) -> Inventory:
    return _sourced(convert_struct(located.data, Inventory, located, path), path)


def _sourced(inventory: Inventory, path: Path) -> Inventory:
    """`inventory`, remembering the file it came from (`Inventory.resolve` needs it)."""
    inventory.__dict__["_source"] = path.resolve() if path.exists() else path
    return inventory


def load_inventory(path: Path | str) -> Inventory:
    """Read and validate an inventory file (at most 1 MiB, UTF-8 YAML)."""
    path = Path(path)
    inventory = load_struct(path, Inventory, what="a mapping with 'cluster' and 'workers'")
    return _sourced(inventory, path)


def _schema_hook(kind: type) -> dict[str, Any]:
    if kind is Path:
        return {"type": "string", "format": "path"}
    msg = f"no JSON Schema for {kind!r}"
    raise NotImplementedError(msg)


def inventory_json_schema() -> dict[str, Any]:
    """The JSON Schema of the inventory (what `ftctl inventory schema` prints)."""
    import msgspec.json

    schema: dict[str, Any] = msgspec.json.schema(Inventory, schema_hook=_schema_hook)
    defs: dict[str, Any] = schema.get("$defs", {})
    root = dict(defs.pop("Inventory"))
    # The root inlined, so that tools see its keys without following a $ref.
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **root, "$defs": defs}
