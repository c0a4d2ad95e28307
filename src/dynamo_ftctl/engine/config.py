"""Engine configs: the `ftctl-sim-tiny` preset and configs read from YAML files.

Kept free of torch so that the CLI and the launcher can validate a config
without loading the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dynamo_ftctl.errors import InvalidInput

__all__ = ["DEFAULT_MODEL", "PRESETS", "EngineConfig", "resolve_engine_config"]

DEFAULT_MODEL = "ftctl-sim-tiny"


class EngineConfig(BaseModel):
    """Model shape, cache and scheduler limits of one engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(DEFAULT_MODEL, min_length=1, description="Served model id.")
    tokenizer: Literal["bpe", "byte"] = Field(
        "bpe", description="bpe: the shipped byte-level BPE (re-tokenized text gives other ids, "
        "as on real engines); byte: one id per byte (exact round trips).")
    vocab_size: int | None = Field(
        None, ge=8, description="Embedding rows (default: the tokenizer's vocabulary).")
    d_model: int = Field(128, ge=8, description="Hidden size.")
    n_layers: int = Field(2, ge=1, le=64)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int = Field(2, ge=1, description="Grouped-query attention: KV heads.")
    head_dim: int = Field(32, ge=2, description="Even: RoPE rotates pairs.")
    ffn_dim: int = Field(256, ge=8, description="SwiGLU hidden size.")
    max_model_len: int = Field(2048, ge=16, description="Prompt + output limit in tokens.")
    rope_theta: float = Field(10000.0, gt=0)
    # Random weights give nearly flat logits; a scale makes the distribution peaked
    # like a trained model's, so greedy decoding has clear winners.
    logit_scale: float = Field(3.0, gt=0)
    ascii_bias: float = Field(4.0, ge=0, description="Logit bonus of printable ASCII tokens.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    num_blocks: int = Field(1024, ge=1, description="KV blocks in the fixed pool.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests decoding at once.")
    max_batched_tokens: int = Field(2048, ge=16, description="Prefill token budget per step.")
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _check_shape(self) -> EngineConfig:
        if self.n_heads % self.n_kv_heads:
            msg = f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            raise ValueError(msg)
        if self.head_dim % 2:
            msg = f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs)"
            raise ValueError(msg)
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies across all layers."""
        width = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}[self.dtype]
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * width


PRESETS: dict[str, EngineConfig] = {
    DEFAULT_MODEL: EngineConfig(),
    # A smaller pool, for tests that exhaust the KV cache on purpose.
    "ftctl-sim-tiny-small-cache": EngineConfig(name=DEFAULT_MODEL, num_blocks=24, max_num_seqs=8),
}


def resolve_engine_config(name_or_path: str, **overrides: object) -> EngineConfig:
    """A preset by name, or a YAML file of `EngineConfig` fields; `overrides` win.

    Errors are `InvalidInput` naming the file, line and key.
    """
    if name_or_path in PRESETS:
        base = PRESETS[name_or_path]
        data = base.model_dump()
    else:
        path = Path(name_or_path)
        if not path.suffix and not path.exists():
            known = ", ".join(PRESETS)
            msg = f"unknown model config {name_or_path!r} (presets: {known}; or a YAML file)"
            raise InvalidInput(msg)
        from dynamo_ftctl.inventory import (
            load_yaml_document,
            validation_error_to_inventory_error,
        )

        data, located = load_yaml_document(path, what="an engine config mapping")
        try:
            EngineConfig.model_validate(data)
        except ValidationError as exc:
            raise validation_error_to_inventory_error(exc, EngineConfig, located, path) from None
        data = dict(data)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        key = ".".join(str(p) for p in first["loc"])
        msg = f"engine config: {key}: {first['msg']}"
        raise InvalidInput(msg) from None
