"""The names of every fault ftctl can inject, and which are destructive.

The inventory's per-worker `faults` allowlist is checked against this catalog;
`xid<N>` is a fault for every N in the Xid catalog (`xid.py`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["FAULTS", "FaultSpec", "check_fault", "fault_names", "is_known_fault"]


class FaultSpec(NamedTuple):
    """One fault: what it does and whether it takes a worker out of service.

    A NamedTuple, not a dataclass: `dataclasses` imports `inspect`, which the one-shot
    canary probe (it loads the inventory, which checks fault names) must not pay for.
    """

    name: str
    summary: str
    destructive: bool


FAULTS: dict[str, FaultSpec] = {
    spec.name: spec
    for spec in (
        FaultSpec("kill", "SIGKILL the engine process", destructive=True),
        FaultSpec("term", "SIGTERM the engine process", destructive=True),
        FaultSpec("hang", "SIGSTOP the engine (SIGCONT on revert)", destructive=True),
        FaultSpec("slow", "add a delay to every generated token", destructive=False),
        FaultSpec("disconnect", "drop every stream after N tokens", destructive=False),
        FaultSpec("sdc", "silently corrupt logits (wrong tokens, fast answers)", destructive=False),
        FaultSpec("ecc", "report rising uncorrectable ECC counts", destructive=False),
        FaultSpec("thermal", "slow tokens plus a thermal throttle reason", destructive=False),
        FaultSpec("net-latency", "add latency and jitter in the TCP fault proxy",
                  destructive=False),
        FaultSpec("net-reset", "reset connections in the TCP fault proxy", destructive=True),
        FaultSpec("net-blackhole", "accept and never answer in the TCP fault proxy",
                  destructive=True),
        FaultSpec("net-bandwidth", "limit bandwidth in the TCP fault proxy", destructive=False),
        FaultSpec("overload", "saturate the worker with requests", destructive=False),
    )
}

_XID_FAULT = re.compile(r"^xid(\d{1,4})$")


def is_known_fault(name: str) -> bool:
    """True for a catalog fault or `xid<N>` with N in the Xid catalog."""
    if name in FAULTS:
        return True
    match = _XID_FAULT.match(name)
    if match is None:
        return False
    from dynamo_ftctl.xid import XID_CATALOG

    return int(match.group(1)) in XID_CATALOG


def fault_names() -> list[str]:
    """Every fault name, the Xid faults included, for help texts and errors."""
    from dynamo_ftctl.xid import XID_CATALOG

    return [*FAULTS, *(f"xid{code}" for code in sorted(XID_CATALOG))]


def check_fault(value: str) -> str:
    """A fault of the catalog (a struct field's check); ValueError with a close match otherwise."""
    if not is_known_fault(value):
        # structs (msgspec) is loaded only on this error path: the catalog stays light.
        from dynamo_ftctl.structs import close_matches

        close = close_matches(value, fault_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        msg = f"unknown fault {value!r}{hint}; `ftctl inject --list` shows the catalog"
        raise ValueError(msg)
    return value
