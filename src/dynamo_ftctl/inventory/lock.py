"""The `lock:` section: the failover lock's backend (flock or etcd) and where it lives."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta, field

from dynamo_ftctl.structs import StrictStruct, check_http_url, doc

__all__ = ["EtcdConfig", "LockConfig"]


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
