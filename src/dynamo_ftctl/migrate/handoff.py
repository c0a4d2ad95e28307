"""The KV handoff: a broken generation's KV cache moved to the next worker.

With a calibration (`ftctl migrate calibrate`, `proxy.calibration`) whose cost model
says a transfer is faster than re-prefill, the failed worker's KV is exported
(`migrate.transfer.export_request`, the same call as `ftctl migrate request`) and
imported on the target (`/admin/kv/import`), which streams the continuation. A
SIGKILLed worker has nothing to export; any failure of the export or the import
falls back to re-prefill (the migration policy decides, `proxy/policy.py`).

With a calibration of workers that share ftctl's vLLM KV connector's store (`via:
store`, `ftctl migrate calibrate --via store`) nothing is exported: the re-prefill
itself loads the context's blocks from the store, unless the cost model says
recomputing them is faster, and then the continuation is sent with
`kv_transfer_params.ftctl_load` false (`store_choice`).

The exports go through an `http1.Client` of their own (one call per migration, off the
hot path), bounded by the connect and stall timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo_ftctl.clock import Clock
    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.inventory import Inventory
    from dynamo_ftctl.inventory.proxy import ProxyConfig
    from dynamo_ftctl.migrate.calibrate import Calibration
    from dynamo_ftctl.migrate.transfer import Endpoint
    from dynamo_ftctl.proxy.balancer import WorkerSlot
    from dynamo_ftctl.proxy.ledger import StreamLedger

__all__ = ["KvHandoff", "load_proxy_calibration"]

log = logging.getLogger("ftctl.proxy")


def load_proxy_calibration(inventory: Inventory, config: ProxyConfig) -> Calibration | None:
    """The proxy's calibration (its path relative to the inventory), or None."""
    if config.calibration is None:
        return None
    from dynamo_ftctl.migrate.calibrate import load_calibration

    return load_calibration(inventory.resolve(config.calibration))


class KvHandoff:
    """KV exports from failed workers and the imports that continue on the next one."""

    def __init__(self, inventory: Inventory, config: ProxyConfig, clock: Clock) -> None:
        self.inventory = inventory
        self.config = config
        self.clock = clock
        self.calibration = load_proxy_calibration(inventory, config)
        self._client: Client | None = None  # one-shot KV exports

    async def aclose(self) -> None:
        """Close the client of the KV exports, if one was opened; the handoff may open another."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    def export_budget(self, ledger: StreamLedger) -> float:
        """Seconds to give a KV export when the calibrated model prefers a transfer, else 0.

        Completions with token ids only: a KV import streams completion chunks, and
        its context must be exactly the ledger's prompt + generated ids. The budget is
        twice the modelled re-prefill (at least 0.5 s, at most the stall timeout): an
        export slower than that has lost to re-prefill already (a hung worker).
        """
        if self.calibration is None or self.calibration.via != "export" \
                or ledger.endpoint != "completions" \
                or not ledger.ids_mode or ledger.prompt_ids is None:
            return 0.0
        from dynamo_ftctl.migrate.transfer import RequestState, choose_method

        context = (*ledger.prompt_ids, *ledger.generated_ids)
        state = RequestState(
            request_id=ledger.upstream_id, model=self.calibration.model, token_ids=context,
            prompt_len=len(ledger.prompt_ids), num_cached=len(context), sampling={},
            kv_bytes_per_token=self.calibration.kv_bytes_per_token, payload_bytes=0,
        )
        plan = choose_method(state, self.calibration)
        if plan.decision != "kv":
            return 0.0
        return min(max(2 * plan.reprefill_s, 0.5), self.config.stall_timeout_s)

    def store_choice(self, body: dict[str, Any]) -> dict[str, Any]:
        """A token-id continuation's `body` as it goes to workers sharing ftctl's KV
        connector's store: unchanged where the calibrated model prefers loading the
        context from the store (the connector's default) or there is no store
        calibration; else a copy whose `kv_transfer_params` (the client's, if any, kept)
        turn the load off. Never raises."""
        prompt = body.get("prompt")
        if self.calibration is None or self.calibration.via != "store" \
                or not isinstance(prompt, list):
            return body
        from dynamo_ftctl.kv.blockstore import LOAD_PARAM
        from dynamo_ftctl.migrate.cost import plan_migration

        c = self.calibration
        plan = plan_migration(c.model_preset(), tp=1, tokens=len(prompt), link=c.link(),
                              block_size=c.block_size, prefill=c.prefill_model(),
                              prefill_source="calibrated")
        if plan.decision == "kv":
            return body
        params = body.get("kv_transfer_params")
        return {**body, "kv_transfer_params": {
            **(params if isinstance(params, dict) else {}), LOAD_PARAM: False}}

    async def export(self, slot: WorkerSlot, ledger: StreamLedger, budget_s: float) -> bytes:
        """Export (and stop) the request on the failed worker; b"" when it cannot be moved."""
        from dynamo_ftctl.errors import FtctlError
        from dynamo_ftctl.http1 import Client
        from dynamo_ftctl.migrate.transfer import export_request

        if self._client is None:
            self._client = Client()
        try:
            async with asyncio.timeout(budget_s):
                state, payload, _ = await export_request(
                    self._client, self._endpoint(slot), ledger.upstream_id,
                    abort=True, clock=self.clock,
                    timeout_s=min(self.config.stall_timeout_s, budget_s),
                )
        except (FtctlError, ValueError, TimeoutError) as exc:  # gone, hung, no KV, garbage
            log.info("no KV export from %s (%s): re-prefill", slot.name, exc)
            return b""
        context = [*(ledger.prompt_ids or ()), *ledger.generated_ids]
        if list(state.token_ids) != context:
            # It decoded tokens the client never saw (their text is lost): re-prefill.
            log.info("KV export from %s holds %d tokens, the client saw %d: re-prefill",
                     slot.name, len(state.token_ids), len(context))
            return b""
        return payload

    def import_request(self, slot: WorkerSlot, payload: bytes,
                       ledger: StreamLedger) -> tuple[str, bytes, dict[str, str]]:
        """URL, body and headers of the import that continues the request on `slot`."""
        target = self._endpoint(slot)
        headers = {**target.admin_headers(), "X-Request-Id": ledger.upstream_id,
                   "Content-Type": "application/octet-stream"}
        return f"{target.admin_url}/admin/kv/import", payload, headers

    def _endpoint(self, slot: WorkerSlot) -> Endpoint:
        """`slot`'s endpoint: its inventory entry's, or, for a worker the inventory this
        handoff started with does not name (found in DNS, added by a reload), the worker
        URL as admin URL with the default token variable (an inventory worker's defaults).
        Never an error: an import raised here would fail a request that can go on."""
        from dynamo_ftctl.errors import FtctlError
        from dynamo_ftctl.migrate.transfer import Endpoint, endpoint_for

        try:
            return endpoint_for(self.inventory, slot.name)
        except FtctlError:
            return Endpoint(name=slot.name, url=slot.url, admin_url=slot.url,
                            token=os.environ.get("FTCTL_ADMIN_TOKEN"), group=slot.group)
