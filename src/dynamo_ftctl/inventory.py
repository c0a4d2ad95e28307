"""The cluster inventory: frozen pydantic models and a loader whose errors name file:line: key.

One YAML file describes the cluster; every command reads it through
`load_inventory`. Unknown keys, duplicate worker names, bad URLs, faults that
are not in the fault catalog and references to undeclared groups are errors.
Every error is one line: `ftctl.yaml:12: workers[2].url: not a valid http(s) URL`.

This module must not import anything heavy: it runs in probes and entrypoints.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from dynamo_ftctl.errors import InvalidInput, InventoryError

__all__ = [
    "MAX_YAML_BYTES",
    "AdminEndpoint",
    "BusyThresholds",
    "CanaryConfig",
    "EtcdConfig",
    "Group",
    "InjectConfig",
    "Inventory",
    "Launch",
    "LockConfig",
    "ProcessRef",
    "ProxyConfig",
    "SimLaunch",
    "TransitionAction",
    "Worker",
    "format_key_path",
    "inventory_json_schema",
    "load_inventory",
    "load_yaml_document",
    "parse_inventory",
]

# A cluster inventory of 1,000 workers is ~200 KiB; anything past 1 MiB is a mistake.
MAX_YAML_BYTES = 1024 * 1024

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
    from dynamo_ftctl.faults.catalog import fault_names, is_known_fault

    if not is_known_fault(value):
        close = _close_matches(value, fault_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        msg = f"unknown fault {value!r}{hint}; `ftctl inject --list` shows the catalog"
        raise ValueError(msg)
    return value


HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
Name = Annotated[str, AfterValidator(_check_name)]
HostPort = Annotated[str, AfterValidator(_check_host_port)]
FaultName = Annotated[str, AfterValidator(_check_fault)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class AdminEndpoint(_Model):
    """A worker's admin API (fault endpoint, KV export/import, sleep/wake)."""

    url: HttpUrl | None = Field(None, description="Admin base URL; default: the worker URL.")
    token_env: str = Field(
        "FTCTL_ADMIN_TOKEN", description="Environment variable that holds the bearer token.",
    )


class ProcessRef(_Model):
    """How to find a worker's process for signal faults."""

    pid_file: Path | None = Field(None, description="File holding the engine's pid.")
    pid: int | None = Field(None, gt=0, description="A fixed pid (tests, static hosts).")


class InjectConfig(_Model):
    """How `ftctl inject` reaches a worker: which injectors, and where they write."""

    injectors: tuple[Literal["signal", "http", "kmsg", "dcgm", "net"], ...] = Field(
        ("signal", "http"), description="Injectors allowed on this worker, in preference order.",
    )
    kmsg_path: Path = Field(
        Path("/dev/kmsg"), description="Kernel log the kmsg injector writes Xid lines to.",
    )
    pci_bus_id: str = Field(
        "0000:3b:00", description="PCI bus id named in injected Xid lines (no GPU: a stand-in).",
    )
    netproxy: HttpUrl | None = Field(
        None, description="Control URL of the TCP fault proxy in front of this worker.",
    )


class SimLaunch(_Model):
    """Start this worker as an `ftctl sim` engine with `--local` / `ftctl sim cluster`."""

    seed: int = Field(0, ge=0, description="Weight seed: same seed, same model.")
    model_config_name: str = Field(
        "ftctl-sim-tiny", alias="model_config", description="Engine config preset or YAML path.",
    )
    args: tuple[str, ...] = Field((), description="Extra `ftctl sim serve` flags.")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Launch(_Model):
    """Local launch recipe (only for workers started by ftctl itself)."""

    sim: SimLaunch | None = None


class Worker(_Model):
    """One inference engine endpoint (OpenAI-compatible)."""

    name: Name
    url: HttpUrl = Field(description="OpenAI-compatible base URL, e.g. http://10.0.0.3:8000.")
    model: str = Field(min_length=1, description="Served model id.")
    node: str = Field("localhost", min_length=1, description="Host the engine runs on.")
    gpus: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        (), description="GPU indices on the node.",
    )
    group: Name | None = Field(None, description="TP/PP group: fails and migrates as a unit.")
    admin: AdminEndpoint | None = None
    process: ProcessRef | None = None
    faults: tuple[FaultName, ...] = Field((), description="Faults `ftctl inject` may use here.")
    protected: bool = Field(False, description="Refuse every fault injection on this worker.")
    inject: InjectConfig = Field(
        InjectConfig(), description="Injectors `ftctl inject` may use on this worker.",
    )
    launch: Launch | None = None

    @property
    def admin_url(self) -> str:
        """Base URL of the admin API (the worker URL unless overridden)."""
        return self.admin.url if self.admin and self.admin.url else self.url


class Group(_Model):
    """A tensor/pipeline-parallel group of workers that fail and migrate together."""

    name: Name
    tp: int = Field(1, ge=1, description="Tensor-parallel degree.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree.")


HealthStateName = Literal["healthy", "suspicious", "unhealthy", "draining", "dead"]


class TransitionAction(_Model):
    """What the canary daemon does when a worker enters one of `on` (HTTP call or command)."""

    on: tuple[HealthStateName, ...] = Field(
        ("unhealthy",), min_length=1, description="States whose entry triggers the action.",
    )
    http: HttpUrl | None = Field(
        None, description="POST {worker, state, previous, reason} as JSON to this URL.",
    )
    token_env: str | None = Field(
        None, description="Variable holding a bearer token for the HTTP call.",
    )
    command: tuple[str, ...] | None = Field(
        None, min_length=1,
        description="argv to run with FTCTL_WORKER, FTCTL_STATE, FTCTL_PREVIOUS_STATE set.",
    )
    timeout_s: float = Field(10.0, gt=0, description="Give up on the action after this long.")

    @model_validator(mode="after")
    def _one_kind(self) -> TransitionAction:
        if (self.http is None) == (self.command is None):
            raise KeyedValueError(("http",), "give exactly one of 'http' or 'command'")
        return self


class CanaryConfig(_Model):
    """Canary probing and the health state machine."""

    interval_s: float = Field(30.0, gt=0, description="Seconds between probes of a worker.")
    timeout_s: float = Field(10.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(2, ge=0, le=10, description="Retries on transient errors only.")
    set: str | None = Field(None, description="Canary set YAML, relative to the inventory.")
    latency_spike_factor: float = Field(3.0, gt=1.0)
    ema_alpha: float = Field(0.1, gt=0.0, le=1.0)
    failure_threshold: int = Field(
        3, ge=1, le=100, description="Consecutive failures that make a worker UNHEALTHY.",
    )
    recovery_s: float = Field(
        60.0, gt=0, description="Seconds an open breaker waits before one half-open trial.",
    )
    dead_after_trials: int = Field(
        2, ge=1, le=100,
        description="Failed half-open trials before DEAD (the first one moves to DRAINING).",
    )
    concurrency: int = Field(
        256, ge=1, le=10000, description="Probes in flight at once in the daemon.",
    )
    listen: HostPort = Field(
        "127.0.0.1:8090", description="Daemon HTTP address (/workers, /report, /metrics).",
    )
    state_file: str | None = Field(
        None, description="Latency baseline file (default: $XDG_STATE_HOME/ftctl/canary.json).",
    )
    transition_log: str | None = Field(
        None, description="Append every state transition here as a JSON line.",
    )
    actions: tuple[TransitionAction, ...] = Field(
        (), description="HTTP calls or commands run on state transitions.",
    )


class EtcdConfig(_Model):
    """etcd lock backend (engines on different nodes)."""

    endpoints: tuple[HttpUrl, ...] = Field(("http://127.0.0.1:2379",), min_length=1)
    key: str = Field("/ftctl/locks/failover", min_length=1)
    ttl_s: float = Field(5.0, ge=1.0, le=3600.0)


class LockConfig(_Model):
    """The failover lock shared by a primary and its shadow."""

    backend: Literal["flock", "etcd"] = "flock"
    path: Path | None = Field(None, description="flock file (default: $FAILOVER_LOCK_PATH).")
    etcd: EtcdConfig = EtcdConfig()


class BusyThresholds(_Model):
    """When a worker counts as busy for admission control."""

    active_decode_blocks_threshold: float = Field(0.85, ge=0.0, le=1.0)
    active_prefill_tokens_threshold: int = Field(8192, ge=0)


class ProxyConfig(_Model):
    """The migrating front door."""

    listen: HostPort = "127.0.0.1:8000"
    migration_limit: int = Field(3, ge=0, le=100)
    busy: BusyThresholds = BusyThresholds()
    stall_timeout_s: float = Field(
        15.0, gt=0, description="A worker that sends no token for this long has failed.",
    )
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout per worker.")
    health_url: HttpUrl | None = Field(
        None, description="Canary daemon base URL (GET /workers, POST /report); none: own breaker.",
    )
    reject_status: Literal[503, 529] = Field(
        503, description="HTTP status when every worker is busy or a tier is shed.",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) on a rejection.")
    admin_token_env: str = Field(
        "FTCTL_ADMIN_TOKEN",
        description="Variable holding the bearer token of POST /busy_threshold.",
    )
    scrape_interval_s: float = Field(
        1.0, gt=0, description="Seconds between scrapes of workers' /metrics and the daemon.",
    )
    breaker_threshold: int = Field(
        3, ge=1, description="Consecutive failures that open a worker's breaker (no daemon).",
    )
    breaker_recovery_s: float = Field(
        60.0, gt=0, description="Seconds an open breaker waits before one trial request.",
    )


class Inventory(_Model):
    """A whole cluster: workers, their groups and the settings of every service."""

    cluster: Name
    workers: tuple[Worker, ...] = Field(min_length=1)
    groups: tuple[Group, ...] = ()
    canary: CanaryConfig = CanaryConfig()
    lock: LockConfig = LockConfig()
    proxy: ProxyConfig = ProxyConfig()

    _source: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_references(self) -> Inventory:
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
        return self

    @property
    def source(self) -> Path | None:
        """The file this inventory was loaded from, if any."""
        return self._source

    def worker(self, name: str) -> Worker:
        """The worker called `name`; an `InvalidInput` naming close matches otherwise."""
        for worker in self.workers:
            if worker.name == name:
                return worker
        names = [w.name for w in self.workers]
        close = _close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; workers: {', '.join(names)}"
        where = f"{self._source}: " if self._source else ""
        msg = f"{where}no worker named {name!r}{hint}"
        raise InvalidInput(msg)

    def group_of(self, worker: Worker) -> str:
        """The failure domain of a worker: its group, else the worker itself."""
        return worker.group or worker.name

    def resolve(self, relative: str | Path) -> Path:
        """A path from the inventory, resolved against the inventory file's folder."""
        path = Path(relative).expanduser()
        if path.is_absolute() or self._source is None:
            return path
        return self._source.parent / path


# ---------------------------------------------------------------------------
# Loading YAML with line numbers


def format_key_path(loc: Sequence[str | int]) -> str:
    """`("workers", 2, "url")` -> `workers[2].url`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        msg = "no such file"
        raise InventoryError(msg, path=path) from None
    except OSError as exc:
        raise InventoryError(exc.strerror or str(exc), path=path) from None
    if path.is_dir():
        msg = "is a directory, expected a YAML file"
        raise InventoryError(msg, path=path)
    if size > MAX_YAML_BYTES:
        msg = f"file is {size:,} bytes; the limit is {MAX_YAML_BYTES:,} (1 MiB)"
        raise InventoryError(msg, path=path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise InventoryError(exc.strerror or str(exc), path=path) from None
    if len(raw) > MAX_YAML_BYTES:
        msg = f"file is over {MAX_YAML_BYTES:,} bytes (1 MiB)"
        raise InventoryError(msg, path=path)
    return _decode(raw, path)


def _decode(raw: bytes, path: Path) -> str:
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        msg = "binary data (NUL byte), expected UTF-8 YAML text"
        raise InventoryError(msg, path=path, line=line)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        msg = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        raise InventoryError(msg, path=path, line=line) from None
    return text.removeprefix("\ufeff")


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


def _parse_yaml(text: str, path: Path) -> _Located:
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return _Located(None, {})
        lines: dict[tuple[str | int, ...], int] = {(): node.start_mark.line + 1}
        _walk_lines(node, (), lines, set(), path)
        data = yaml.SafeLoader(text).get_single_data()
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
    return _Located(data, lines)


def load_yaml_document(path: Path, *, what: str = "a mapping") -> tuple[Any, _Located]:
    """Read a YAML file of at most 1 MiB and return (data, line map).

    Shared by the inventory, canary sets and drill scenarios so all three give
    the same one-line errors. The document must be a mapping.
    """
    located = _parse_yaml(_read_text(path), path)
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
    try:
        inventory = Inventory.model_validate(located.data)
    except ValidationError as exc:
        raise validation_error_to_inventory_error(exc, Inventory, located, path) from None
    inventory._source = path.resolve() if path.exists() else path
    return inventory


def load_inventory(path: Path | str) -> Inventory:
    """Read and validate an inventory file (at most 1 MiB, UTF-8 YAML)."""
    path = Path(path)
    _, located = load_yaml_document(
        path, what="a mapping with 'cluster' and 'workers'",
    )
    return _validate(located, path)


def inventory_json_schema() -> dict[str, Any]:
    """The JSON Schema of the inventory (what `ftctl inventory schema` prints)."""
    return Inventory.model_json_schema(by_alias=True)
