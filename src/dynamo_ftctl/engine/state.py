"""What one `ftctl sim` server runs with: its settings, the engine it serves, its faults.

`build_state` loads torch and builds the model, cache and driver; `apply_fault` acts
on a fault (crash and hang on the event loop, the others recorded for the engine
and the streams). The HTTP side is in `routes`; this module answers no request.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.engine.config import EngineConfig
from dynamo_ftctl.engine.faults import FaultSpec, FaultState, xid_crash_lines
from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from dynamo_ftctl.engine.driver import AsyncEngine
    from dynamo_ftctl.engine.metrics import EngineMetrics
    from dynamo_ftctl.engine.scheduler import Engine

__all__ = ["ServerSettings", "ServerState", "apply_fault", "build_state"]


@dataclass(frozen=True)
class ServerSettings:
    """How to run one engine server."""

    config: EngineConfig
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    admin_token: str | None = None
    faults: tuple[FaultSpec, ...] = ()
    pci_bus_id: str = "0000:3b:00"
    pid_file: Path | None = None
    threads: int | None = 1
    # Real engines take seconds to minutes on their first request (graph capture,
    # compilation); vLLM's first request once took over 20 s in our drills.
    warmup_s: float = 1.0
    lenient_fields: bool = False  # True: ignore unknown request fields (the pre-pydantic way)
    # Answer as NVIDIA Dynamo's frontend does: no token ids (the field is ignored), an
    # `nvext` object in every chunk, the prompt's ids in an `event: token_ids` block.
    dynamo: bool = False
    # From a request's first byte to its last (nginx: 60 s for the head): a slow or stalled
    # client (slowloris) is answered 408 and its socket freed.
    request_timeout_s: float = 30.0


@dataclass
class ServerState:
    """Everything the handlers share."""

    settings: ServerSettings
    engine: Engine
    driver: AsyncEngine
    faults: FaultState
    metrics: EngineMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    warm: bool = False
    warming: asyncio.Future[None] | None = None


def build_state(settings: ServerSettings) -> ServerState:
    """Build the model, cache and driver for `settings` (loads torch)."""
    import torch

    from dynamo_ftctl.engine.driver import AsyncEngine
    from dynamo_ftctl.engine.metrics import EngineMetrics
    from dynamo_ftctl.engine.scheduler import Engine

    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        msg = f"--device {settings.device}: CUDA is not available on this machine"
        raise InvalidInput(msg)
    engine = Engine(settings.config, settings.seed, settings.device)
    faults = FaultState(settings.pci_bus_id)
    metrics = EngineMetrics(settings.config.name, block_size=settings.config.block_size,
                            num_blocks=settings.config.num_blocks)
    return ServerState(settings, engine, AsyncEngine(engine, faults, metrics), faults, metrics)


def _crash(spec: FaultSpec, pci_bus_id: str) -> None:
    for line in xid_crash_lines(spec.xid, pci_bus_id):
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(spec.exit_code)


def apply_fault(state: ServerState, spec: FaultSpec) -> None:
    """Act on a fault: schedule crash/hang on the event loop, record the others."""
    loop = asyncio.get_running_loop()
    # A short delay lets the admin call's own response leave first.
    delay = spec.after_s + 0.05
    if spec.kind == "crash":
        loop.call_later(delay, _crash, spec, state.settings.pci_bus_id)
    elif spec.kind == "hang":
        loop.call_later(delay, state.faults.hang, spec.duration_s)
    else:
        state.faults.apply(spec)
        state.engine.corrupt_logits = state.faults.sdc
