"""The one-shot fleet report behind `ftctl inventory show --probe`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.capabilities.cache import CapabilityCache
from dynamo_ftctl.capabilities.fetch import probe_client
from dynamo_ftctl.capabilities.probe import DEFAULT_TIMEOUT_S, Capabilities

if TYPE_CHECKING:
    from dynamo_ftctl.http1.transport import AsyncTransport
    from dynamo_ftctl.inventory import Inventory

__all__ = ["CapabilityReport", "probe_inventory", "probe_inventory_sync"]


def _mark(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


_HEADERS = ("worker", "token_ids", "chat_ids", "strict", "tokenize", "health", "metrics",
            "load", "sleep", "kv_export", "max_len", "server")


@dataclass(frozen=True)
class CapabilityReport:
    """`ftctl inventory show --probe`: every worker's capabilities."""

    cluster: str
    workers: tuple[Capabilities, ...]
    wall_s: float

    @property
    def exit_code(self) -> int:
        """0 when every worker answered, 3 (unreachable) when any did not."""
        from dynamo_ftctl.errors import ExitCode

        ok = all(c.reachable for c in self.workers)
        return int(ExitCode.OK if ok else ExitCode.UNREACHABLE)

    def rows(self) -> list[tuple[str, ...]]:
        """One row of cells per worker, under `headers`."""
        out = []
        for c in self.workers:
            if not c.reachable:
                out.append((c.worker, *(["?"] * (len(_HEADERS) - 2)), c.error or "unreachable"))
                continue
            load = {"vllm": "vllm", "vllm_old": "vllm-old", "none": "none"}.get(
                c.load_metric or "", "?")
            out.append((
                c.worker, _mark(c.token_ids), _mark(c.chat_token_ids), _mark(c.strict_fields),
                _mark(c.tokenize), _mark(c.health), _mark(c.metrics), load, _mark(c.sleep),
                _mark(c.kv_export), str(c.max_model_len) if c.max_model_len else "?",
                c.server or "-",
            ))
        return out

    @property
    def headers(self) -> tuple[str, ...]:
        """The table's column names."""
        return _HEADERS

    def _footer(self) -> str:
        down = sum(not c.reachable for c in self.workers)
        state = f"{down} unreachable (exit 3)" if down else "all answered"
        return f"{len(self.workers)} workers, {state}, in {self.wall_s * 1000:.0f} ms\n"

    def plain_text(self) -> str:
        """Aligned columns for pipes and logs."""
        from dynamo_ftctl.output import plain_table

        return (f"# cluster {self.cluster}\n" + plain_table(self.headers, self.rows())
                + self._footer())

    def __rich__(self) -> Any:
        from rich.console import Group

        from dynamo_ftctl.output import table

        return Group(table(f"cluster {self.cluster}: capabilities", self.headers, self.rows()),
                     self._footer().rstrip("\n"))


async def probe_inventory(inventory: Inventory, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                          transport: AsyncTransport | None = None) -> CapabilityReport:
    """Probe every worker of `inventory` at once (through `transport`, or a
    `probe_client()` of its own)."""
    start = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        if transport is None:
            own = probe_client()
            stack.push_async_callback(own.close)
            transport = own
        cache = CapabilityCache(transport=transport, timeout_s=timeout_s)
        workers = await cache.probe_all(inventory.workers)
    return CapabilityReport(inventory.cluster, workers, round(time.monotonic() - start, 4))


def probe_inventory_sync(inventory: Inventory, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                         transport: AsyncTransport | None = None) -> CapabilityReport:
    """`probe_inventory` for callers without an event loop (the CLI)."""
    return asyncio.run(probe_inventory(inventory, timeout_s=timeout_s, transport=transport))
