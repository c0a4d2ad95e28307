"""The `workers:` and `groups:` sections: each engine endpoint and the groups they fail in.

A worker's faults are checked against the fault catalog (`faultnames.check_fault`);
whether its `group` is declared is the whole file's check (`Inventory`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta, field

from dynamo_ftctl.faultnames import check_fault
from dynamo_ftctl.inventory.launch import Launch
from dynamo_ftctl.structs import StrictStruct, check_http_url, check_name, doc

__all__ = ["AdminEndpoint", "Group", "InjectConfig", "ProcessRef", "Worker"]


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


class Group(StrictStruct, frozen=True):
    """A tensor/pipeline-parallel group of workers that fail and migrate together."""

    name: str
    tp: Annotated[int, doc("Tensor-parallel degree.", ge=1)] = 1
    pp: Annotated[int, doc("Pipeline-parallel degree.", ge=1)] = 1
    _checked = (("name", check_name),)
