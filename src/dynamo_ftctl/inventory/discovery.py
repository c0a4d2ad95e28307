"""The `discovery:` section: workers found in DNS (the resolving is `dynamo_ftctl.discovery`'s)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from dynamo_ftctl.structs import KeyedValueError, StrictStruct, check_host_port, check_name, doc

__all__ = ["DnsWorkers", "check_dns_name"]


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
