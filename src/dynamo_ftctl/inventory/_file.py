"""The whole inventory file: `Inventory`, its cross-section checks, and its loaders.

`Inventory` gathers the sections (`workers`, `discovery`, `canary`, `lock`, `proxy`
modules) and checks what no section can see alone: names unique across a list, each
worker's `group` declared, discovery only with one proxy process. `load_inventory`
and `parse_inventory` turn YAML into it; every error is one line naming file, line
and key. `inventory_json_schema` is what `ftctl inventory schema` prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from msgspec import field

from dynamo_ftctl.documents import MAX_DOCUMENT_BYTES, parse_yaml
from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.inventory.canary import CanaryConfig
from dynamo_ftctl.inventory.discovery import DnsWorkers
from dynamo_ftctl.inventory.lock import LockConfig
from dynamo_ftctl.inventory.proxy import ProxyConfig
from dynamo_ftctl.inventory.workers import Group, Worker
from dynamo_ftctl.structs import (
    KeyedValueError,
    StrictStruct,
    check_name,
    close_matches,
    convert_struct,
    doc,
    load_struct,
)

if TYPE_CHECKING:
    from dynamo_ftctl.documents import Located

__all__ = [
    "MAX_YAML_BYTES",
    "Inventory",
    "inventory_json_schema",
    "load_inventory",
    "parse_inventory",
]

# The limit of every YAML document ftctl reads (see `documents`).
MAX_YAML_BYTES = MAX_DOCUMENT_BYTES


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
