"""The cluster inventory: frozen msgspec structs and a loader whose errors name file:line: key.

One YAML file describes the cluster; every command reads it through
`load_inventory`. Unknown keys, duplicate worker names, bad URLs, faults that
are not in the fault catalog and references to undeclared groups are errors.
Every error is one line: `ftctl.yaml:12: workers[2].url: not a valid http(s) URL`.

This package runs in Kubernetes exec probes and engine entrypoints, so it must
start fast: the structs are `structs.StrictStruct`s (msgspec) and the YAML is
read by `documents` (bounded, with the line of every key).

One module per section of the file, none of which knows another: `workers`
(`workers:` and `groups:`, with a worker's `launch:` recipe in `launch`),
`discovery`, `canary`, `lock`, `proxy`. `_file` holds `Inventory`, the checks
across sections, and the loaders. This face exports the whole file and its
workers; a service imports its own section from its module
(`from dynamo_ftctl.inventory.proxy import ProxyConfig`).
"""

from __future__ import annotations

from dynamo_ftctl.inventory._file import (
    MAX_YAML_BYTES,
    Inventory,
    inventory_json_schema,
    load_inventory,
    parse_inventory,
)
from dynamo_ftctl.inventory.workers import Worker

__all__ = [
    "MAX_YAML_BYTES",
    "Inventory",
    "Worker",
    "inventory_json_schema",
    "load_inventory",
    "parse_inventory",
]
