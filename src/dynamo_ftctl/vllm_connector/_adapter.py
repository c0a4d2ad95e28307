"""`FtctlConnector`: vLLM's v1 KV connector interface over `Planner` and `BlockMover`.

The only module of the connector that knows vLLM's classes; it imports vLLM (and
torch) inside `connector_class`, so the package imports without them. The class
is built once per process. Its scheduler role plans (`_plan`), its worker role
moves blocks (`_worker`); every method is a short translation between vLLM's
objects and theirs. Loads are synchronous (done in `start_load_kv` before the
forward pass), saves too (`wait_for_save`, after it): no block is freed or
rewritten while the connector reads it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv.blockstore import REPORT_PARAM, BlockStore, namespace_key
from dynamo_ftctl.vllm_connector._plan import Planner, StepPlan
from dynamo_ftctl.vllm_connector._worker import BlockMover

__all__ = ["ConnectorSettings", "connector_class", "settings_from"]

log = logging.getLogger("dynamo_ftctl.vllm_connector")

DEFAULT_BUDGET_BYTES = 10 << 30


class ConnectorSettings:
    """`kv_connector_extra_config`, checked: `store` (a directory shared by the workers)
    and `budget_bytes` (default 10 GiB)."""

    def __init__(self, store: Path, budget_bytes: int) -> None:
        self.store = store
        self.budget_bytes = budget_bytes


def settings_from(extra: Any) -> ConnectorSettings:
    """Settings from vLLM's `kv_connector_extra_config`; `InvalidInput` names what is
    wrong."""
    if not isinstance(extra, dict) or not isinstance(extra.get("store"), str) \
            or not extra["store"]:
        msg = ("FtctlConnector needs kv_connector_extra_config.store: a directory shared "
               "by the workers")
        raise InvalidInput(msg)
    budget = extra.get("budget_bytes", DEFAULT_BUDGET_BYTES)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        msg = f"kv_connector_extra_config.budget_bytes must be a positive integer (got {budget!r})"
        raise InvalidInput(msg)
    return ConnectorSettings(Path(extra["store"]), budget)


def _namespace(vllm_config: Any, kv_cache_config: Any) -> bytes:
    """What must agree for two engines' blocks to be interchangeable."""
    model, cache, parallel = (vllm_config.model_config, vllm_config.cache_config,
                              vllm_config.parallel_config)
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if groups else None
    return namespace_key(
        "ftctl-vllm-1", model.model, getattr(model, "revision", None), model.dtype,
        cache.cache_dtype, cache.block_size, parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size, type(spec).__name__,
        getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None),
        getattr(spec, "dtype", None), len(groups),
        sum(len(g.layer_names) for g in groups),
    )


def _geometry(vllm_config: Any, kv_cache_config: Any) -> dict[str, int]:
    """The KV geometry of one rank's cache, as `ftctl migrate calibrate` records it."""
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if groups else None
    dtype = getattr(spec, "dtype", None)
    return {"layers": sum(len(g.layer_names) for g in groups),
            "kv_heads": int(getattr(spec, "num_kv_heads", 0) or 0),
            "head_dim": int(getattr(spec, "head_size", 0) or 0),
            "dtype_bytes": int(getattr(dtype, "itemsize", 0) or 0),
            "block_size": int(vllm_config.cache_config.block_size)}


def _shard(tp_rank: int, pp_rank: int) -> str:
    return f".{pp_rank}-{tp_rank}"


def _adopt_vllm_logging() -> None:
    """Send this package's log lines where vLLM's go (it configures only "vllm")."""
    if not log.handlers:
        for handler in logging.getLogger("vllm").handlers:
            log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


@functools.cache
def connector_class() -> type:
    """The `FtctlConnector` class (a `KVConnectorBase_V1`), built on first use."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )

    class FtctlConnector(KVConnectorBase_V1):  # type: ignore[misc]
        """Saves every full KV block to a shared store; loads a request's leading blocks
        from it (module docstring of `dynamo_ftctl.vllm_connector`)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            super().__init__(vllm_config=vllm_config, role=role,
                             kv_cache_config=kv_cache_config)
            _adopt_vllm_logging()
            settings = settings_from(self._kv_transfer_config.kv_connector_extra_config)
            self._store = BlockStore(settings.store, settings.budget_bytes)
            parallel = vllm_config.parallel_config
            self._planner: Planner | None = None
            self._mover: BlockMover | None = None
            if role == KVConnectorRole.SCHEDULER:
                shards = [_shard(t, p) for p in range(parallel.pipeline_parallel_size)
                          for t in range(parallel.tensor_parallel_size)]
                self._planner = Planner(self._store, _namespace(vllm_config, kv_cache_config),
                                        vllm_config.cache_config.block_size, shards)
                self._geometry = _geometry(vllm_config, kv_cache_config)
                log.info("ftctl KV connector: store %s, budget %d bytes, block %d tokens",
                         settings.store, settings.budget_bytes,
                         vllm_config.cache_config.block_size)
            else:
                from vllm.distributed.parallel_state import (
                    get_pp_group,
                    get_tensor_model_parallel_rank,
                )

                suffix = _shard(get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
                self._mover = BlockMover(self._store, suffix=suffix)

        @property
        def requires_kv_delivery(self) -> bool:
            return False  # a best-effort cache: a dropped save is a later miss

        # ---------------------------------------------------------- worker role

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            assert self._mover is not None
            self._mover.register(kv_caches, self._kv_cache_config.num_blocks)
            log.info("ftctl KV connector: %d cache tensors, blocks on dim %d, %s",
                     len(self._mover.caches), self._mover.block_dim,
                     self._mover.geometry.decode(errors="replace")[:200])

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:  # noqa: ARG002
            plan = self._get_connector_metadata()
            if self._mover is not None and isinstance(plan, StepPlan) and plan.loads:
                self._mover.run(plan)

        def wait_for_layer_load(self, layer_name: str) -> None:  # noqa: ARG002 (vLLM's API)
            return  # every load finished in start_load_kv

        def save_kv_layer(self, layer_name: str, kv_layer: Any,  # noqa: ARG002 (vLLM's API)
                          attn_metadata: Any, **kwargs: Any) -> None:  # noqa: ARG002
            return  # whole blocks are saved after the forward pass (wait_for_save)

        def wait_for_save(self) -> None:
            if not self.has_connector_metadata():
                return
            plan = self._get_connector_metadata()
            if self._mover is not None and isinstance(plan, StepPlan) and plan.saves:
                self._mover.save(plan.saves)

        def get_block_ids_with_load_errors(self) -> set[int]:
            return self._mover.failed_blocks() if self._mover is not None else set()

        def shutdown(self) -> None:
            if self._mover is not None:
                log.info("ftctl KV connector: %s", self._mover.stats)

        # ---------------------------------------------------------- scheduler role

        def on_new_request(self, request: Any) -> None:
            if self._planner is not None:
                self._planner.track(request)

        def get_num_new_matched_tokens(self, request: Any,
                                       num_computed_tokens: int) -> tuple[int, bool]:
            assert self._planner is not None
            return self._planner.matched_tokens(request, num_computed_tokens), False

        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            assert self._planner is not None
            self._planner.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            assert self._planner is not None
            manager = self._kv_cache_manager
            scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            scheduled.extend(scheduler_output.scheduled_cached_reqs.req_ids)
            return self._planner.plan(
                scheduled, lambda rid: manager.get_block_ids(rid)[0] if manager else [])

        def request_finished(
            self, request: Any, block_ids: list[int],  # noqa: ARG002 (vLLM's API)
        ) -> tuple[bool, dict[str, Any] | None]:
            if self._planner is None:
                return False, None
            loaded = self._planner.finished(request.request_id)
            params = request.kv_transfer_params
            if isinstance(params, dict) and params.get(REPORT_PARAM) is True:
                # vLLM puts these in a non-streamed answer's kv_transfer_params.
                return False, {REPORT_PARAM: {"loaded_tokens": loaded, **self._geometry}}
            return False, None

    FtctlConnector.__module__ = "dynamo_ftctl.vllm_connector"
    return FtctlConnector
