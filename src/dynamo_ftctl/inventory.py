"""The cluster inventory: frozen msgspec structs and a loader whose errors name file:line: key.

One YAML file describes the cluster; every command reads it through
`load_inventory`. Unknown keys, duplicate worker names, bad URLs, faults that
are not in the fault catalog and references to undeclared groups are errors.
Every error is one line: `ftctl.yaml:12: workers[2].url: not a valid http(s) URL`.

This module runs in Kubernetes exec probes and engine entrypoints, so it must
start fast. The models are `msgspec.Struct`s, not pydantic models: importing
msgspec and validating costs ~10 ms where pydantic's import, plugin scan and
schema build cost ~120 ms (`benchmarks/startup.py`). The other file formats
(canary sets aside) are pydantic models that reuse this module's YAML loader
and its `validation_error_to_inventory_error`; pydantic is imported only there.
The structs keep pydantic's `model_copy`, `model_dump` and `model_validate`
names so callers need not care which library validated them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, field

from dynamo_ftctl.documents import MAX_DOCUMENT_BYTES, check_yaml_bounds, read_document
from dynamo_ftctl.errors import InvalidInput, InventoryError

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError

__all__ = [
    "MAX_YAML_BYTES",
    "AdminEndpoint",
    "BusyThresholds",
    "CanaryConfig",
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
    "validation_error_to_inventory_error",
]

# The limit of every YAML document ftctl reads (see `documents`).
MAX_YAML_BYTES = MAX_DOCUMENT_BYTES

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


class KeyedValueError(ValueError):
    """A validation error raised by a model validator about one key below the model."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def _close_matches(word: str, choices: Sequence[str], n: int = 1) -> list[str]:
    # difflib costs ~10 ms to import and is needed only on the error path.
    import difflib

    return difflib.get_close_matches(word, choices, n=n)


def _check_http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or (port is not None and not 0 < port < 65536)
        or any(c.isspace() for c in value)
    ):
        msg = f"not a valid http(s) URL: {value!r}"
        raise ValueError(msg)
    return value.rstrip("/")


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        msg = f"invalid name {value!r}: use letters, digits, '.', '_' or '-' (at most 63)"
        raise ValueError(msg)
    return value


def _check_host_port(value: str) -> str:
    match = _HOST_PORT.match(value)
    if match is None or not 0 <= int(match.group(2)) < 65536:
        msg = f"expected HOST:PORT, got {value!r}"
        raise ValueError(msg)
    return value


def _check_fault(value: str) -> str:
    from dynamo_ftctl.faultnames import fault_names, is_known_fault

    if not is_known_fault(value):
        close = _close_matches(value, fault_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        msg = f"unknown fault {value!r}{hint}; `ftctl inject --list` shows the catalog"
        raise ValueError(msg)
    return value


_CHECKS: dict[str, Callable[[str], str]] = {
    "HttpUrl": _check_http_url,
    "Name": _check_name,
    "HostPort": _check_host_port,
    "FaultName": _check_fault,
}


def __getattr__(name: str) -> Any:
    """`Name`, `FaultName`, `HttpUrl`, `HostPort` as pydantic types, for pydantic file formats.

    Built on first use so that loading an inventory never imports pydantic.
    """
    if name in _CHECKS:
        from pydantic import AfterValidator

        annotated = Annotated[str, AfterValidator(_CHECKS[name])]
        globals()[name] = annotated
        return annotated
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


_M = TypeVar("_M", bound="StrictStruct")


class StrictStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A frozen struct that refuses unknown keys (base of every file format on the fast path).

    Checks that types cannot express run in `__post_init__`: `_checked` names
    fields and their string checks; subclasses add cross-field rules there.
    """

    # (field name, check) pairs; a tuple field's items are checked one by one.
    _checked: ClassVar[tuple[tuple[str, Callable[[str], str]], ...]] = ()

    def __post_init__(self) -> None:
        for name, check in self._checked:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, tuple):
                checked: Any = tuple(_at(check, item, (name, i)) for i, item in enumerate(value))
            else:
                checked = _at(check, value, (name,))
            if checked != value:
                msgspec.structs.force_setattr(self, name, checked)

    @classmethod
    def model_validate(cls: type[_M], data: Any) -> _M:
        """Validate plain data (as from YAML or JSON); `InvalidInput` names the key."""
        return convert_struct(data, cls)

    def model_copy(self: _M, *, update: Mapping[str, Any] | None = None) -> _M:
        """A copy with `update` applied (not re-validated, as pydantic's)."""
        copy = msgspec.structs.replace(self, **dict(update or {}))
        extra = getattr(self, "__dict__", None)
        if extra:
            copy.__dict__.update(extra)
        return copy

    def model_dump(
        self, *, mode: str = "json", by_alias: bool = True, exclude_none: bool = False,
    ) -> dict[str, Any]:
        """Plain data with the file's key names, as `model_validate` reads it back."""
        del mode, by_alias  # always JSON-compatible, always the file's key names
        data: dict[str, Any] = _plain(msgspec.to_builtins(self, enc_hook=str), exclude_none)
        return data


def _at(check: Callable[[str], str], value: str, loc: tuple[str | int, ...]) -> str:
    try:
        return check(value)
    except ValueError as exc:
        raise KeyedValueError(loc, str(exc)) from None


def _plain(value: Any, exclude_none: bool) -> Any:
    """JSON-shaped data: tuples become lists; with `exclude_none`, None values go."""
    if isinstance(value, dict):
        return {
            k: _plain(v, exclude_none) for k, v in value.items()
            if v is not None or not exclude_none
        }
    if isinstance(value, list | tuple):
        return [_plain(v, exclude_none) for v in value]
    return value


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is Path:
        if isinstance(value, str) and value:
            return Path(value)
        msg = "expected a path"
        raise ValueError(msg)
    msg = f"unsupported type {kind!r}"
    raise NotImplementedError(msg)


def _doc(text: str, **constraints: Any) -> Meta:
    """A field's one-line description (shown by `ftctl inventory schema`) and its bounds."""
    return Meta(description=text, **constraints)


class AdminEndpoint(StrictStruct, frozen=True):
    """A worker's admin API (fault endpoint, KV export/import, sleep/wake)."""

    url: Annotated[str | None, _doc("Admin base URL; default: the worker URL.")] = None
    token_env: Annotated[str, _doc("Environment variable that holds the bearer token.")] = (
        "FTCTL_ADMIN_TOKEN"  # noqa: S105 - the variable's name, not a secret
    )
    _checked = (("url", _check_http_url),)


class ProcessRef(StrictStruct, frozen=True):
    """How to find a worker's process for signal faults."""

    pid_file: Annotated[Path | None, _doc("File holding the engine's pid.")] = None
    pid: Annotated[int, _doc("A fixed pid (tests, static hosts).", gt=0)] | None = None
    group: Annotated[
        bool,
        _doc("Signal the pid's whole process group (it must lead one): an engine of several "
             "processes, e.g. vLLM's API server, engine core and workers, dies or stops as "
             "one."),
    ] = False


class InjectConfig(StrictStruct, frozen=True):
    """How `ftctl inject` reaches a worker: which injectors, and where they write."""

    injectors: Annotated[
        tuple[Literal["signal", "http", "kmsg", "dcgm", "net"], ...],
        _doc("Injectors allowed on this worker, in preference order."),
    ] = ("signal", "http")
    kmsg_path: Annotated[
        Path, _doc("Kernel log the kmsg injector writes Xid lines to (default /dev/kmsg)."),
    ] = field(default_factory=lambda: Path("/dev/kmsg"))
    pci_bus_id: Annotated[
        str, _doc("PCI bus id named in injected Xid lines (no GPU: a stand-in)."),
    ] = "0000:3b:00"
    netproxy: Annotated[
        str | None, _doc("Control URL of the TCP fault proxy in front of this worker."),
    ] = None
    netproxy_token_env: Annotated[
        str, _doc("Variable holding the fault proxy's control token (bearer).", min_length=1),
    ] = "FTCTL_NETPROXY_TOKEN"  # noqa: S105 - the variable's name, not a secret
    _checked = (("netproxy", _check_http_url),)


class SimLaunch(StrictStruct, frozen=True):
    """Start this worker as an `ftctl sim` engine with `--local` / `ftctl sim cluster`."""

    seed: Annotated[int, _doc("Weight seed: same seed, same model.", ge=0)] = 0
    model_config_name: Annotated[str, _doc("Engine config preset or YAML path.")] = field(
        default="ftctl-sim-tiny", name="model_config",
    )
    warmup_s: Annotated[
        float, _doc("Extra delay of the first request (`--warmup-s`; default 1.0).", ge=0),
    ] | None = None
    args: Annotated[tuple[str, ...], _doc("Extra `ftctl sim serve` flags.")] = ()


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
        _doc("argv of an OpenAI server, with {host}, {port}, {model} and ${VAR}.",
             min_length=1),
    ] | None = None
    env: Annotated[dict[str, str], _doc("command: extra environment (values take ${VAR}).")] = (
        field(default_factory=dict)
    )
    health_path: Annotated[str, _doc("command: path that answers 200 once it serves.")] = (
        "/health"
    )
    start_timeout_s: Annotated[
        float, _doc("command: seconds to wait for health.", gt=0, le=3600),
    ] = 300.0
    warmup: Annotated[
        bool, _doc("command: one short completion once healthy (vLLM's first is slow)."),
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
    url: Annotated[str, _doc("OpenAI-compatible base URL, e.g. http://10.0.0.3:8000.")]
    model: Annotated[str, _doc("Served model id.", min_length=1)]
    node: Annotated[str, _doc("Host the engine runs on.", min_length=1)] = "localhost"
    gpus: Annotated[tuple[Annotated[int, Meta(ge=0)], ...], _doc("GPU indices on the node.")] = ()
    group: Annotated[str | None, _doc("TP/PP group: fails and migrates as a unit.")] = None
    admin: AdminEndpoint | None = None
    process: ProcessRef | None = None
    faults: Annotated[tuple[str, ...], _doc("Faults `ftctl inject` may use here.")] = ()
    protected: Annotated[bool, _doc("Refuse every fault injection on this worker.")] = False
    inject: Annotated[InjectConfig, _doc("Injectors `ftctl inject` may use on this worker.")] = (
        field(default_factory=InjectConfig)
    )
    launch: Launch | None = None
    _checked = (
        ("name", _check_name), ("url", _check_http_url), ("group", _check_name),
        ("faults", _check_fault),
    )

    @property
    def admin_url(self) -> str:
        """Base URL of the admin API (the worker URL unless overridden)."""
        return self.admin.url if self.admin and self.admin.url else self.url


class Group(StrictStruct, frozen=True):
    """A tensor/pipeline-parallel group of workers that fail and migrate together."""

    name: str
    tp: Annotated[int, _doc("Tensor-parallel degree.", ge=1)] = 1
    pp: Annotated[int, _doc("Pipeline-parallel degree.", ge=1)] = 1
    _checked = (("name", _check_name),)


HealthStateName = Literal["healthy", "suspicious", "unhealthy", "draining", "dead"]


class TransitionAction(StrictStruct, frozen=True):
    """What the canary daemon does when a worker enters one of `on` (HTTP call or command)."""

    on: Annotated[
        tuple[HealthStateName, ...], _doc("States whose entry triggers the action.", min_length=1),
    ] = ("unhealthy",)
    http: Annotated[
        str | None, _doc("POST {worker, state, previous, reason} as JSON to this URL."),
    ] = None
    token_env: Annotated[str | None, _doc("Variable holding a bearer token for the HTTP call.")] = (
        None
    )
    command: Annotated[
        tuple[str, ...],
        _doc("argv to run with FTCTL_WORKER, FTCTL_STATE, FTCTL_PREVIOUS_STATE set.", min_length=1),
    ] | None = None
    timeout_s: Annotated[float, _doc("Give up on the action after this long.", gt=0)] = 10.0
    _checked = (("http", _check_http_url),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.http is None) == (self.command is None):
            raise KeyedValueError(("http",), "give exactly one of 'http' or 'command'")


class CanaryConfig(StrictStruct, frozen=True):
    """Canary probing and the health state machine."""

    interval_s: Annotated[float, _doc("Seconds between probes of a worker.", gt=0)] = 30.0
    timeout_s: Annotated[float, _doc("Per-request timeout.", gt=0)] = 10.0
    max_retries: Annotated[int, _doc("Retries on transient errors only.", ge=0, le=10)] = 2
    set: Annotated[str | None, _doc("Canary set YAML, relative to the inventory.")] = None
    latency_spike_factor: Annotated[
        float, _doc("A probe slower than this times the EMA baseline is a latency spike.", gt=1.0),
    ] = 3.0
    ema_alpha: Annotated[
        float, _doc("Weight of the newest latency in the EMA baseline.", gt=0.0, le=1.0),
    ] = 0.1
    failure_threshold: Annotated[
        int, _doc("Consecutive failures that make a worker UNHEALTHY.", ge=1, le=100),
    ] = 3
    recovery_s: Annotated[
        float, _doc("Seconds an open breaker waits before one half-open trial.", gt=0),
    ] = 60.0
    dead_after_trials: Annotated[
        int,
        _doc("Failed half-open trials before DEAD (the first one moves to DRAINING).", ge=1,
             le=100),
    ] = 2
    parallel_prompts: Annotated[
        bool,
        _doc("Send a set's prompts at once: a probe's latency is its slowest answer (false: "
             "one after another, its latency is their sum)."),
    ] = True
    concurrency: Annotated[
        int, _doc("Probes in flight at once in the daemon.", ge=1, le=10000),
    ] = 256
    listen: Annotated[str, _doc("Daemon HTTP address (/workers, /report, /metrics).")] = (
        "127.0.0.1:8090"
    )
    token_env: Annotated[
        str,
        _doc("Variable holding the bearer token of POST /report (unset: reports refused, "
             "403); `ftctl gpu --report` sends it too.", min_length=1),
    ] = "FTCTL_DAEMON_TOKEN"  # noqa: S105 - the variable's name, not a secret
    report_rate_per_s: Annotated[
        float, _doc("Reports a second one client address may send (beyond: 429).", gt=0),
    ] = 10.0
    report_burst: Annotated[
        int, _doc("Reports one client address may send at once.", ge=1, le=10000),
    ] = 20
    state_file: Annotated[
        str | None, _doc("Latency baseline file (default: $XDG_STATE_HOME/ftctl/canary.json)."),
    ] = None
    transition_log: Annotated[
        str | None, _doc("Append every state transition here as a JSON line."),
    ] = None
    actions: Annotated[
        tuple[TransitionAction, ...], _doc("HTTP calls or commands run on state transitions."),
    ] = ()
    _checked = (("listen", _check_host_port),)


class EtcdConfig(StrictStruct, frozen=True):
    """etcd lock backend (engines on different nodes)."""

    endpoints: Annotated[tuple[str, ...], Meta(min_length=1)] = ("http://127.0.0.1:2379",)
    key: Annotated[str, Meta(min_length=1)] = "/ftctl/locks/failover"
    ttl_s: Annotated[float, Meta(ge=1.0, le=3600.0)] = 5.0
    _checked = (("endpoints", _check_http_url),)


class LockConfig(StrictStruct, frozen=True):
    """The failover lock shared by a primary and its shadow."""

    backend: Literal["flock", "etcd"] = "flock"
    path: Annotated[Path | None, _doc("flock file (default: $FAILOVER_LOCK_PATH).")] = None
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
        float, _doc("Retries in flight allowed, as a percentage of the requests in flight.",
                    ge=0.0, le=100.0),
    ] = 20.0
    min_retry_concurrency: Annotated[
        int, _doc("Retries in flight always allowed, whatever the traffic.", ge=0),
    ] = 3


class ProxyConfig(StrictStruct, frozen=True):
    """The migrating front door."""

    listen: str = "127.0.0.1:8000"
    migration_limit: Annotated[int, Meta(ge=0, le=100)] = 3
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    retry_budget: RetryBudget = field(default_factory=RetryBudget)
    stall_timeout_s: Annotated[
        float, _doc("A worker that sends no token for this long has failed.", gt=0),
    ] = 15.0
    connect_timeout_s: Annotated[float, _doc("TCP connect timeout per worker.", gt=0)] = 2.0
    health_url: Annotated[
        str | None,
        _doc("Canary daemon base URL (GET /workers, POST /report); none: own breaker."),
    ] = None
    health_token_env: Annotated[
        str,
        _doc("Variable holding the daemon's bearer token for POST /report (unset: failures "
             "are not reported).", min_length=1),
    ] = "FTCTL_DAEMON_TOKEN"  # noqa: S105 - the variable's name, not a secret
    reject_status: Annotated[
        Literal[503, 529], _doc("HTTP status when every worker is busy or a tier is shed."),
    ] = 503
    premium_when_busy: Annotated[
        Literal["admit", "shed"],
        _doc("When every worker is busy: admit premium requests to queue at the least-loaded "
             "worker (standard and best_effort get the busy 503), or shed them too."),
    ] = "admit"
    retry_after_s: Annotated[int, _doc("Retry-After (seconds) on a rejection.", ge=0)] = 1
    admin_token_env: Annotated[
        str, _doc("Variable holding the bearer token of POST /busy_threshold."),
    ] = "FTCTL_ADMIN_TOKEN"  # noqa: S105 - the variable's name, not a secret
    scrape_interval_s: Annotated[
        float, _doc("Seconds between scrapes of workers' /metrics and the daemon.", gt=0),
    ] = 1.0
    breaker_threshold: Annotated[
        int, _doc("Consecutive failures that open a worker's breaker (no daemon).", ge=1),
    ] = 3
    breaker_recovery_s: Annotated[
        float, _doc("Seconds an open breaker waits before one trial request.", gt=0),
    ] = 60.0
    calibration: Annotated[
        str | None,
        _doc("Calibration file (`ftctl migrate calibrate`, relative to the inventory): a "
             "live failed worker's KV is moved when it says a transfer beats re-prefill; "
             "none: always re-prefill."),
    ] = None
    max_connections: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc("Client connections at most; one more is answered 503 and closed. Default: "
             "what the open-file limit leaves room for, at most 4096."),
    ] = None
    max_buffered_mib: Annotated[
        int,
        _doc("MiB of requests not yet answered (partial bodies included) held across all "
             "clients; the request that would go over is answered 503.", ge=1),
    ] = 256
    _checked = (("listen", _check_host_port), ("health_url", _check_http_url))


class Inventory(StrictStruct, frozen=True, dict=True):
    """A whole cluster: workers, their groups and the settings of every service."""

    cluster: str
    workers: Annotated[tuple[Worker, ...], Meta(min_length=1)]
    groups: tuple[Group, ...] = ()
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    lock: LockConfig = field(default_factory=LockConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    _checked = (("cluster", _check_name),)

    def __post_init__(self) -> None:
        super().__post_init__()
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
        close = _close_matches(name, names, n=1)
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


# ---------------------------------------------------------------------------
# Loading YAML with line numbers


def format_key_path(loc: Sequence[str | int]) -> str:
    """`("workers", 2, "url")` -> `workers[2].url`; odd keys quoted: `workers[2]['a b']`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part or not part.isprintable() or any(c in part for c in " .[]'\""):
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class _Located:
    """A YAML document plus the line of every key path in it."""

    def __init__(self, data: Any, lines: dict[tuple[str | int, ...], int]) -> None:
        self.data = data
        self.lines = lines

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        """The line of the deepest existing prefix of `loc`."""
        parts = tuple(loc)
        while parts:
            if parts in self.lines:
                return self.lines[parts]
            parts = parts[:-1]
        return self.lines.get(())


def _walk_lines(
    node: Any, loc: tuple[str | int, ...], lines: dict[tuple[str | int, ...], int],
    seen: set[int], path: Path,
) -> None:
    import yaml

    # Aliases reuse one node object: visiting each once keeps "billion laughs" linear.
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            line = key_node.start_mark.line + 1
            if key in keys:
                msg = f"duplicate key {key!r}"
                raise InventoryError(msg, path=path, line=line, key=format_key_path((*loc, key)))
            keys.add(key)
            lines[(*loc, key)] = line
            _walk_lines(value_node, (*loc, key), lines, seen, path)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*loc, index)] = item.start_mark.line + 1
            _walk_lines(item, (*loc, index), lines, seen, path)


_LOADER: Any = None


def _loader() -> Any:
    """PyYAML's safe loader (libyaml when present) with YAML 1.2 booleans, no timestamps.

    YAML 1.1 reads `on`, `off`, `yes`, `no`, `y`, `n` as booleans, which turns
    `canary.actions[].on` into `True` and a worker called `no` into `False`;
    here only true/false (any case) are booleans, as in YAML 1.2. Nor does a
    date-like value become a datetime (`2020-13-45` failed inside PyYAML): it
    stays a string, as in YAML 1.2's core schema.
    """
    global _LOADER  # noqa: PLW0603 - built once per process, on first use
    if _LOADER is None:
        import yaml

        base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        bool_tag = "tag:yaml.org,2002:bool"
        dropped = {bool_tag, "tag:yaml.org,2002:timestamp"}
        resolvers = {
            first: [(tag, regexp) for tag, regexp in entries if tag not in dropped]
            for first, entries in base.yaml_implicit_resolvers.items()
        }
        _LOADER = type("FtctlLoader", (base,), {"yaml_implicit_resolvers": resolvers})
        _LOADER.add_implicit_resolver(
            bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"),
        )
    return _LOADER


def _parse_yaml(text: str, path: Path) -> _Located:
    """Parse `text` (named `path` in errors), through the content-addressed cache."""
    from dynamo_ftctl import yamlcache

    cached = yamlcache.lookup(text)
    if cached is not None:
        return _Located(*cached)
    located = _parse_yaml_text(text, path)
    yamlcache.store(text, located.data, located.lines)
    return located


def _parse_yaml_text(text: str, path: Path) -> _Located:
    import yaml

    try:
        # Bounds first, on events alone: an alias bomb is refused before PyYAML composes
        # it, before `_walk_lines`, validation or the cache see its expansion.
        check_yaml_bounds(text, path)
        loader = _loader()(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return _Located(None, {})
            lines: dict[tuple[str | int, ...], int] = {(): node.start_mark.line + 1}
            _walk_lines(node, (), lines, set(), path)
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        msg = f"YAML syntax error: {problem}"
        raise InventoryError(msg, path=path, line=line) from None
    except yaml.YAMLError as exc:
        msg = f"YAML error: {exc}".splitlines()[0]
        raise InventoryError(msg, path=path) from None
    except RecursionError:
        msg = "YAML nested too deeply"
        raise InventoryError(msg, path=path) from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        # A constructor PyYAML did not guard; the bounds check leaves few (tags, dates).
        msg = f"YAML value ftctl cannot read: {exc}"
        raise InventoryError(msg, path=path) from None
    return _Located(data, lines)


def load_yaml_document(path: Path, *, what: str = "a mapping") -> tuple[Any, _Located]:
    """Read a YAML file within `documents`' bounds (1 MiB, 64 levels, aliases repeating
    at most 10,000 nodes) and return (data, line map).

    Shared by the inventory, canary sets and drill scenarios so all three give
    the same one-line errors. The document must be a mapping.
    """
    located = _parse_yaml(read_document(path), path)
    if located.data is None:
        msg = f"empty document, expected {what}"
        raise InventoryError(msg, path=path, line=1)
    if not isinstance(located.data, dict):
        kind = type(located.data).__name__
        kind = {"list": "a list", "str": "a string", "int": "a number"}.get(kind, kind)
        msg = f"expected {what} at the top level, got {kind}"
        raise InventoryError(msg, path=path, line=located.lines.get((), 1))
    return located.data, located


_MESSAGES = {
    "missing": "missing required key",
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
}


def _describe(error: Mapping[str, Any], model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        key = str(loc[-1]) if loc else ""
        close = _close_matches(key, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown key{hint} (allowed: {', '.join(allowed)})"
    if kind == "literal_error":
        return f"must be one of {error['ctx']['expected']}"
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    message = str(error["msg"])
    return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _allowed_keys(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = current.model_fields.get(part) if hasattr(current, "model_fields") else None
        if field is None:
            for candidate in getattr(current, "model_fields", {}).values():
                if candidate.alias == part:
                    field = candidate
        current = _model_in(field.annotation) if field is not None else None
    if current is None or not hasattr(current, "model_fields"):
        return []
    return sorted(f.alias or name for name, f in current.model_fields.items())


def _model_in(annotation: Any) -> type[BaseModel] | None:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _clean_loc(raw: Sequence[Any], data: Any) -> tuple[str | int, ...]:
    """Drop pydantic's internal loc parts (union tags, validator names)."""
    loc: list[str | int] = []
    cursor = data
    for part in raw:
        in_mapping = isinstance(cursor, dict) and part in cursor
        in_list = isinstance(cursor, list) and isinstance(part, int) and 0 <= part < len(cursor)
        if in_mapping or in_list:
            loc.append(part)
            cursor = cursor[part]
        elif isinstance(part, str) and isinstance(cursor, dict) and len(raw) and part == raw[-1]:
            loc.append(part)  # a missing or unknown key: name it though it is absent
            cursor = None
        # anything else is a pydantic-internal tag such as 'function-after[...]'
    return tuple(loc)


def validation_error_to_inventory_error(
    exc: ValidationError, model: type[BaseModel], located: _Located, path: Path,
) -> InventoryError:
    """The first error of a `ValidationError`, as one `file:line: key: message` line."""
    errors = exc.errors(include_url=False)
    # A misspelt key also makes the real one "missing": report the misspelling first.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    raw_loc = tuple(first["loc"])
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, KeyedValueError):
        raw_loc = (*raw_loc, *cause.loc)
    loc = _clean_loc(raw_loc, located.data)
    message = _describe(first, model, loc)
    # A container that failed only because an item inside it failed is not news.
    more = sum(
        1 for e in errors
        if e is not first and tuple(e["loc"]) != tuple(first["loc"])[: len(e["loc"])]
    )
    if more:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return InventoryError(
        message, path=path, line=located.line_of(loc), key=format_key_path(loc) or None,
    )


# ---------------------------------------------------------------------------
# msgspec validation errors as file:line: key: message

_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_TYPE_WORDS = {
    "str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
    "object": "a mapping", "array": "a list", "null": "nothing", "Path": "a path",
}
_EXPECTED = re.compile(r"^Expected `([^`]*)`(?:, got `([^`]*)`)?(.*)$")


def _loc_of(path: str) -> tuple[str | int, ...]:
    """msgspec's `$.workers[2].url` -> `("workers", 2, "url")`."""
    return tuple(
        int(index) if index else key
        for key, index in _PATH_PART.findall(path.removeprefix("$"))
    )


def _field_types(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """A struct's fields by their key in the file (`model_config`, not `model_config_name`)."""
    return {f.encode_name: f.type for f in msgspec.structs.fields(struct)}


def _struct_at(
    model: type[msgspec.Struct], loc: Sequence[str | int],
) -> type[msgspec.Struct] | None:
    """The struct type that holds the value at `loc` (None when `loc` leaves the structs)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        current = _struct_in(_field_types(current).get(part))
        if current is None:
            return None
    return current if isinstance(current, type) else None


def _field_type(model: type[msgspec.Struct], loc: Sequence[str | int]) -> Any:
    """The annotation of the field at `loc` (list indices at its end are skipped)."""
    loc = list(loc)
    while loc and isinstance(loc[-1], int):
        loc.pop()
    holder = _struct_at(model, loc[:-1])
    if holder is None or not loc:
        return None
    return _field_types(holder).get(str(loc[-1]))


def _struct_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    for arg in get_args(annotation):
        found = _struct_in(arg)
        if found is not None:
            return found
    return None


def _literals(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(v for arg in get_args(annotation) for v in _literals(arg))


def _words(types: str) -> str:
    return " or ".join(_TYPE_WORDS.get(t.strip(), t.strip()) for t in types.split("|"))


def msgspec_error_to_inventory_error(
    exc: msgspec.ValidationError, model: type[msgspec.Struct], located: _Located, path: Path,
) -> InventoryError:
    """A msgspec `ValidationError` as one `file:line: key: message` line."""
    text, _, where = str(exc).rpartition(" - at `")
    if not _:
        text, where = str(exc), "$`"
    loc = _loc_of(where.removesuffix("`"))
    cause = exc.__cause__
    if isinstance(cause, KeyedValueError):
        loc = (*loc, *cause.loc)
        message = str(cause)
    elif isinstance(cause, ValueError):
        message = str(cause)
    elif text.startswith("Object contains unknown field `"):
        key = text.split("`")[1]
        holder = _struct_at(model, loc)
        allowed = sorted(_field_types(holder)) if holder else []
        loc = (*loc, key)
        close = _close_matches(key, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = f"unknown key{hint} (allowed: {', '.join(allowed)})"
    elif text.startswith("Object missing required field `"):
        loc = (*loc, text.split("`")[1])
        message = "missing required key"
    elif text.startswith("Invalid enum value"):
        choices = _literals(_field_type(model, loc))
        message = f"must be one of {', '.join(repr(c) for c in choices)}" if choices else text
    elif match := _EXPECTED.match(text):
        expected, got, rest = match.groups()
        if length := re.fullmatch(r" of length ([<>]=) (\d+)", rest):
            bound = "at least" if length.group(1) == ">=" else "at most"
            count = int(length.group(2))
            unit = "item" if expected == "array" else "character"
            message = f"expected {_words(expected)} of {bound} {count} {unit}{'s' * (count != 1)}"
        else:
            message = f"expected {_words(expected)}{rest}"
            if got:
                message += f", got {_words(got)}"
    else:
        message = text
    return InventoryError(
        message, path=path, line=located.line_of(loc), key=format_key_path(loc) or None,
    )


_S = TypeVar("_S", bound=msgspec.Struct)


def convert_struct(
    data: Any, model: type[_S], located: _Located | None = None, path: Path | str = "<data>",
) -> _S:
    """Validate plain data into `model`; errors are one `InventoryError` line."""
    try:
        return msgspec.convert(data, model, strict=False, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        where = located if located is not None else _Located(data, {})
        raise msgspec_error_to_inventory_error(exc, model, where, Path(path)) from None


def parse_inventory(text: str, path: Path | str = "<inventory>") -> Inventory:
    """Validate inventory YAML text; errors name `path`, line and key."""
    path = Path(path)
    located = _parse_yaml(text, path)
    if located.data is None:
        msg = "empty document, expected a mapping with 'cluster' and 'workers'"
        raise InventoryError(msg, path=path, line=1)
    if not isinstance(located.data, dict):
        msg = f"expected a mapping at the top level, got {type(located.data).__name__}"
        raise InventoryError(msg, path=path, line=located.lines.get((), 1))
    return _validate(located, path)


def _validate(located: _Located, path: Path) -> Inventory:
    inventory = convert_struct(located.data, Inventory, located, path)
    inventory.__dict__["_source"] = path.resolve() if path.exists() else path
    return inventory


def load_inventory(path: Path | str) -> Inventory:
    """Read and validate an inventory file (at most 1 MiB, UTF-8 YAML)."""
    path = Path(path)
    _, located = load_yaml_document(
        path, what="a mapping with 'cluster' and 'workers'",
    )
    return _validate(located, path)


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
