"""ftctl's KV connector for vLLM's v1 connector API: every full KV block saved to a store
shared by the workers, loaded by whichever worker next sees the same token prefix.

A stream continued on another worker (`ftctl proxy`'s re-prefill of prompt ids and
generated ids) then loads all but the last block's worth of the prefix instead of
computing it again. Start vLLM with::

    --kv-transfer-config '{"kv_connector": "FtctlConnector", "kv_role": "kv_both",
      "kv_connector_module_path": "dynamo_ftctl.vllm_connector",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "/shared/kv", "budget_bytes": 10737418240}}'

`FtctlConnector` is built on first access (it subclasses vLLM's `KVConnectorBase_V1`):
importing this package loads neither vLLM nor torch. The planning (`_plan`) and the
block moves (`_worker`) know nothing of vLLM's classes; `_adapter` is the only module
that does. docs/kv.md says how to deploy it and what it costs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FtctlConnector"]


def __getattr__(name: str) -> Any:
    if name == "FtctlConnector":
        from dynamo_ftctl.errors import MissingExtra
        from dynamo_ftctl.vllm_connector._adapter import connector_class

        try:
            return connector_class()
        except ImportError as exc:
            missing = MissingExtra.from_import_error(exc)
            if missing is None:
                raise
            raise missing from None
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)
