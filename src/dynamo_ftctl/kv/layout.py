"""Paged KV-cache layout math: bytes per token, per tensor-parallel shard, per block.

Pure arithmetic on integers (no torch): the cost model and the copier share it.

Bytes per token = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes.
Under tensor parallelism the KV heads are split across ranks; when the TP
degree exceeds the number of KV heads each rank keeps one head (heads are
replicated, as vLLM and SGLang do). Multi-head latent attention (DeepSeek-V2/V3)
caches one compressed latent vector per token and layer instead of K and V;
it is not split across TP ranks, so every shard holds all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_ftctl.errors import InvalidInput

__all__ = [
    "DTYPE_BYTES",
    "LAYOUTS",
    "CacheLayout",
    "KVGeometry",
    "blocks_for_tokens",
    "cache_shape",
    "dtype_bytes",
]

# Bytes per element of the KV-cache dtypes engines use.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a KV dtype name (fp16, bf16, fp8, fp32, ...)."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        msg = f"unknown KV dtype {name!r} (known: {known})"
        raise InvalidInput(msg) from None


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks a paged cache needs for `tokens` tokens (the last block may be partial)."""
    if tokens < 0 or block_size <= 0:
        msg = f"tokens must be >= 0 and block size > 0 (got {tokens}, {block_size})"
        raise InvalidInput(msg)
    return -(-tokens // block_size)


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV cache per token.

    `latent_dim` is set for multi-head latent attention (MLA): the elements
    cached per token and layer (DeepSeek-V3: kv_lora_rank 512 + rope 64 = 576);
    `kv_heads` and `head_dim` then do not enter the byte count.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    latent_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                msg = f"{name} must be > 0 (got {getattr(self, name)})"
                raise InvalidInput(msg)
        if self.latent_dim is not None and self.latent_dim <= 0:
            msg = f"latent_dim must be > 0 (got {self.latent_dim})"
            raise InvalidInput(msg)

    @property
    def is_latent(self) -> bool:
        """True for MLA caches (one latent vector per token and layer)."""
        return self.latent_dim is not None

    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across the whole model (all shards, no replicas)."""
        if self.latent_dim is not None:
            return self.layers * self.latent_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_heads_per_shard(self, tp: int) -> int:
        """KV heads each of `tp` ranks holds (at least one: heads replicate past kv_heads)."""
        _check_tp(tp)
        if self.is_latent:
            return self.kv_heads
        if tp <= self.kv_heads:
            if self.kv_heads % tp:
                msg = f"TP degree {tp} does not divide the {self.kv_heads} KV heads"
                raise InvalidInput(msg)
            return self.kv_heads // tp
        if tp % self.kv_heads:
            msg = f"TP degree {tp} is not a multiple of the {self.kv_heads} KV heads"
            raise InvalidInput(msg)
        return 1

    def bytes_per_token_per_shard(self, tp: int) -> int:
        """KV bytes one token occupies on each TP rank (the latent is not split)."""
        if self.latent_dim is not None:
            _check_tp(tp)
            return self.bytes_per_token()
        heads = self.kv_heads_per_shard(tp)
        return 2 * self.layers * heads * self.head_dim * self.dtype_bytes

    def block_bytes_per_shard(self, block_size: int, tp: int) -> int:
        """Bytes of one paged block (all layers) on each TP rank."""
        if block_size <= 0:
            msg = f"block size must be > 0 (got {block_size})"
            raise InvalidInput(msg)
        return block_size * self.bytes_per_token_per_shard(tp)


def _check_tp(tp: int) -> None:
    if tp <= 0:
        msg = f"TP degree must be >= 1 (got {tp})"
        raise InvalidInput(msg)


@dataclass(frozen=True)
class CacheLayout:
    """Where the block index sits in each per-layer cache tensor."""

    name: str
    block_dim: int
    description: str


# vLLM's paged layout, and the flash-attention backend's K/V-first layout.
LAYOUTS: dict[str, CacheLayout] = {
    "vllm": CacheLayout("vllm", 0, "[num_blocks, 2, block_size, kv_heads, head_dim]"),
    "flash": CacheLayout("flash", 1, "[2, num_blocks, block_size, kv_heads, head_dim]"),
}


def cache_shape(
    layout: CacheLayout, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
) -> tuple[int, ...]:
    """The shape of one layer's cache tensor in `layout`."""
    if layout.block_dim == 0:
        return (num_blocks, 2, block_size, kv_heads, head_dim)
    return (2, num_blocks, block_size, kv_heads, head_dim)
