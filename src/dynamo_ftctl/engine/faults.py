"""Faults the engine can play: crash (Xid), contained (Xid), hang, slow, disconnect, sdc,
poison, clear.

`parse_fault` reads the admin endpoint's JSON body or a start-up flag
(`--fault slow:delay_ms=50`) into a `FaultSpec`; `FaultState` holds what is
active. The server applies them: `crash` ends the process with the Xid logged;
`contained` (Xid 94 and the other "request" Xids of the catalog) logs the Xid
and ends only the one request that was running on the faulty context, at the
next step that has one (the engine keeps serving); `hang` stalls the step loop
and every HTTP route but `/admin/fault` without blocking the event loop, until
`clear` or its `duration_s`; `slow` delays every step, `disconnect` drops each
stream after N of its own tokens, `sdc` corrupts logits inside the engine, and
`poison` (`poison:seed=N`) makes a request whose `seed` is N end its whole batch at its
first step, every stream batched with it included, as a request that kills vLLM's
engine core does (`EngineDeadError`); the engine serves on afterwards.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from dynamo_ftctl.engine.scheduler import Engine, TokenEvent

__all__ = [
    "CUDA_ERRORS",
    "FaultKind",
    "FaultSpec",
    "FaultState",
    "parse_fault",
    "parse_fault_flag",
    "xid_crash_lines",
]

FaultKind = Literal["crash", "contained", "hang", "slow", "disconnect", "sdc", "poison",
                    "clear"]
_KINDS: tuple[str, ...] = ("crash", "contained", "hang", "slow", "disconnect", "sdc", "poison",
                           "clear")

# What PyTorch prints when the CUDA call after the Xid fails (the engine's last words).
CUDA_ERRORS: dict[int, str] = {
    13: "CUDA error: an illegal instruction was encountered",
    31: "CUDA error: an illegal memory access was encountered",
    43: "CUDA error: unspecified launch failure",
    48: "CUDA error: uncorrectable ECC error encountered",
    63: "CUDA error: uncorrectable ECC error encountered",
    64: "CUDA error: uncorrectable ECC error encountered",
    74: "CUDA error: uncorrectable NVLink error detected during the execution",
    79: "CUDA error: unspecified launch failure",
    92: "CUDA error: uncorrectable ECC error encountered",
    94: "CUDA error: uncorrectable ECC error encountered",
    95: "CUDA error: uncorrectable ECC error encountered",
    119: "CUDA error: unspecified launch failure",
}


@dataclass(frozen=True)
class FaultSpec:
    """One fault request."""

    kind: FaultKind
    xid: int = 48
    delay_ms: float = 0.0
    after_tokens: int = 0
    after_s: float = 0.0  # crash/hang: wait this long first
    duration_s: float | None = None  # hang: unblock after this long (None: forever)
    exit_code: int = 1
    seed: int = 0  # poison: the request seed that ends its batch


def _number(body: dict[str, Any], key: str, default: float, minimum: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        msg = f"fault field {key!r} must be a number >= {minimum}, got {value!r}"
        raise InvalidInput(msg)
    return float(value)


def parse_fault(body: Any) -> FaultSpec:
    """A `FaultSpec` from a JSON body; `InvalidInput` names the bad field."""
    if not isinstance(body, dict):
        msg = "fault body must be a JSON object with a 'kind'"
        raise InvalidInput(msg)
    kind = body.get("kind")
    if kind not in _KINDS:
        msg = f"unknown fault kind {kind!r}; expected one of {', '.join(_KINDS)}"
        raise InvalidInput(msg)
    allowed = {"kind", "xid", "delay_ms", "after_tokens", "after_s", "duration_s", "exit_code",
               "seed"}
    extra = sorted(set(body) - allowed)
    if extra:
        msg = f"unknown fault field {extra[0]!r}"
        raise InvalidInput(msg)
    xid = int(_number(body, "xid", 94 if kind == "contained" else 48, 1))
    if kind in ("crash", "contained"):
        from dynamo_ftctl.xid import lookup_xid

        lookup_xid(xid)
    if kind == "slow" and "delay_ms" not in body:
        msg = "a slow fault needs 'delay_ms'"
        raise InvalidInput(msg)
    if kind == "disconnect" and "after_tokens" not in body:
        msg = "a disconnect fault needs 'after_tokens'"
        raise InvalidInput(msg)
    if kind == "poison" and "seed" not in body:
        msg = "a poison fault needs 'seed'"
        raise InvalidInput(msg)
    duration = body.get("duration_s")
    return FaultSpec(
        kind=kind, xid=xid, delay_ms=_number(body, "delay_ms", 0, 0),
        after_tokens=int(_number(body, "after_tokens", 0, 0)),
        after_s=_number(body, "after_s", 0, 0),
        duration_s=None if duration is None else _number(body, "duration_s", 0, 0),
        exit_code=int(_number(body, "exit_code", 1, 1)),
        seed=int(_number(body, "seed", 0, 0)),
    )


def parse_fault_flag(text: str) -> FaultSpec:
    """`KIND[:key=value,...]`, e.g. `slow:delay_ms=50` or `crash:xid=79,after_s=5`."""
    kind, _, rest = text.partition(":")
    body: dict[str, Any] = {"kind": kind.strip()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            msg = f"--fault {text!r}: expected key=value, got {item!r}"
            raise InvalidInput(msg)
        try:
            body[key.strip()] = float(value) if "." in value else int(value)
        except ValueError:
            msg = f"--fault {text!r}: {key.strip()} must be a number"
            raise InvalidInput(msg) from None
    return parse_fault(body)


class FaultState:
    """The faults active now (set by the admin endpoint or start-up flags).

    `serving` is set while the engine is not hung: the step loop and the HTTP
    routes await it, so a hang stalls them without blocking the event loop.
    """

    def __init__(self, pci_bus_id: str = "0000:3b:00") -> None:
        self.delay_s = 0.0
        self.disconnect_after: int | None = None
        self.sdc = False
        self.contained_xid: int | None = None
        self.poison_seed: int | None = None
        self.pci_bus_id = pci_bus_id
        self.serving = asyncio.Event()
        self.serving.set()
        self._unhang: asyncio.TimerHandle | None = None

    def hang(self, duration_s: float | None) -> None:
        """Stall steps and requests (on the running loop) until `clear` or `duration_s`."""
        self.serving.clear()
        if self._unhang is not None:
            self._unhang.cancel()
            self._unhang = None
        if duration_s is not None:
            self._unhang = asyncio.get_running_loop().call_later(duration_s, self._resume)

    def _resume(self) -> None:
        if self._unhang is not None:
            self._unhang.cancel()
            self._unhang = None
        self.serving.set()

    def take_contained(self, engine: Engine) -> list[TokenEvent]:
        """An armed contained Xid ends the oldest running request (logged); else nothing."""
        xid = self.contained_xid
        if xid is None or not engine.running:
            return []
        from dynamo_ftctl.engine.scheduler import TokenEvent

        self.contained_xid = None
        victim = engine.running[0].request_id
        engine.abort(victim)
        lines = xid_crash_lines(xid, self.pci_bus_id)[:2]
        lines.append(f"ftctl-sim: Xid {xid} contained: ended request {victim}; serving goes on")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        return [TokenEvent(victim, None, "abort",
                           f"{CUDA_ERRORS.get(xid, 'CUDA error')} (Xid {xid}, contained)")]

    def apply(self, spec: FaultSpec) -> None:
        """Record a fault the server does not act on itself (not `crash`)."""
        if spec.kind == "clear":
            self.delay_s = 0.0
            self.disconnect_after = None
            self.sdc = False
            self.contained_xid = None
            self.poison_seed = None
            self._resume()
        elif spec.kind == "hang":
            self.hang(spec.duration_s)
        elif spec.kind == "contained":
            self.contained_xid = spec.xid
        elif spec.kind == "slow":
            self.delay_s = spec.delay_ms / 1000.0
        elif spec.kind == "disconnect":
            self.disconnect_after = spec.after_tokens
        elif spec.kind == "sdc":
            self.sdc = True
        elif spec.kind == "poison":
            self.poison_seed = spec.seed

    def to_json(self) -> dict[str, Any]:
        """The active faults, for `GET /admin/fault`."""
        return {"slow_delay_ms": self.delay_s * 1000.0,
                "disconnect_after_tokens": self.disconnect_after, "sdc": self.sdc,
                "hung": not self.serving.is_set(), "contained_xid": self.contained_xid,
                "poison_seed": self.poison_seed}


def xid_crash_lines(xid: int, pci_bus_id: str) -> list[str]:
    """The kernel-style Xid line and the CUDA error an engine prints before dying."""
    from dynamo_ftctl.xid import lookup_xid

    info = lookup_xid(xid)
    name = Path(sys.executable).name or "python3"
    cuda = CUDA_ERRORS.get(xid, "CUDA error: unspecified launch failure")
    return [
        f"NVRM: Xid (PCI:{pci_bus_id}): {xid}, pid={os.getpid()}, name={name}, {info.meaning}",
        f"RuntimeError: {cuda}",
        "CUDA kernel errors might be asynchronously reported at some other API call, "
        "so the stacktrace below might be incorrect.",
    ]
