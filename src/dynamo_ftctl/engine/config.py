"""Engine configs: the `ftctl-sim-tiny` preset and configs read from YAML files.

Kept free of torch so that the CLI and the launcher can validate a config
without loading the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta

from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.structs import KeyedValueError, StrictStruct, convert_struct, doc, to_data

__all__ = ["DEFAULT_MODEL", "PRESETS", "EngineConfig", "resolve_engine_config"]

DEFAULT_MODEL = "ftctl-sim-tiny"


class EngineConfig(StrictStruct, frozen=True, kw_only=True):
    """Model shape, cache and scheduler limits of one engine."""

    name: Annotated[str, doc("Served model id.", min_length=1)] = DEFAULT_MODEL
    tokenizer: Annotated[
        Literal["bpe", "byte"],
        doc("bpe: the shipped byte-level BPE (re-tokenized text gives other ids, as on real "
            "engines); byte: one id per byte (exact round trips)."),
    ] = "bpe"
    vocab_size: Annotated[
        int, doc("Embedding rows (default: the tokenizer's vocabulary).", ge=8),
    ] | None = None
    d_model: Annotated[int, doc("Hidden size.", ge=8)] = 128
    n_layers: Annotated[int, Meta(ge=1, le=64)] = 2
    n_heads: Annotated[int, Meta(ge=1)] = 4
    n_kv_heads: Annotated[int, doc("Grouped-query attention: KV heads.", ge=1)] = 2
    head_dim: Annotated[int, doc("Even: RoPE rotates pairs.", ge=2)] = 32
    ffn_dim: Annotated[int, doc("SwiGLU hidden size.", ge=8)] = 256
    max_model_len: Annotated[int, doc("Prompt + output limit in tokens.", ge=16)] = 2048
    rope_theta: Annotated[float, Meta(gt=0)] = 10000.0
    # Random weights give nearly flat logits; a scale makes the distribution peaked
    # like a trained model's, so greedy decoding has clear winners.
    logit_scale: Annotated[float, Meta(gt=0)] = 3.0
    ascii_bias: Annotated[float, doc("Logit bonus of printable ASCII tokens.", ge=0)] = 4.0
    block_size: Annotated[int, doc("Tokens per KV block.", ge=1)] = 16
    num_blocks: Annotated[int, doc("KV blocks in the fixed pool.", ge=1)] = 1024
    max_num_seqs: Annotated[int, doc("Most requests decoding at once.", ge=1)] = 64
    max_batched_tokens: Annotated[int, doc("Prefill token budget per step.", ge=16)] = 2048
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    nondeterministic: Annotated[
        bool,
        doc("Answer greedy (temperature 0) requests with a random pick among the likeliest "
            "tokens, never a stop token the greedy pick would not have made, as Dynamo's "
            "mocker or a server reusing cached prefixes: the same greedy prompt gets another "
            "answer of the same length each time."),
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_heads % self.n_kv_heads:
            msg = f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            raise KeyedValueError(("n_heads",), msg)
        if self.head_dim % 2:
            msg = f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs)"
            raise KeyedValueError(("head_dim",), msg)

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
        data = to_data(PRESETS[name_or_path])
    else:
        path = Path(name_or_path)
        if not path.suffix and not path.exists():
            known = ", ".join(PRESETS)
            msg = f"unknown model config {name_or_path!r} (presets: {known}; or a YAML file)"
            raise InvalidInput(msg)
        from dynamo_ftctl.structs import load_struct

        data = to_data(load_struct(path, EngineConfig, what="an engine config mapping"))
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return convert_struct(data, EngineConfig)
    except InventoryError as exc:
        where = f"{exc.key}: " if exc.key else ""
        msg = f"engine config: {where}{exc.reason}"
        raise InvalidInput(msg) from None
