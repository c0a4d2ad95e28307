"""The tiny decoder-only transformer: RoPE, RMSNorm, grouped-query attention, SwiGLU.

Weights come from `torch.Generator().manual_seed(seed)` on the CPU in float32
and are then cast and moved, so one seed gives the same model on every device.
The forward pass reads and writes a paged KV cache through slot indices
(`block * block_size + offset`): new tokens of every scheduled sequence are
flattened into one batch for the linear layers (one forward per step), and
attention runs once for all single-token decodes (padded to the longest
context) and once per sequence that brings several new tokens (prefill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (torch's convention)

from dynamo_ftctl.engine.config import EngineConfig

__all__ = ["DTYPES", "AttentionPlan", "KVPool", "TinyTransformer", "torch_dtype"]

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's `dtype` name."""
    return DTYPES[name]


class KVPool:
    """The paged cache's storage: per layer, K and V as flat slots × kv heads × head dim."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        slots = config.num_blocks * config.block_size
        shape = (config.n_layers, slots, config.n_kv_heads, config.head_dim)
        dtype = torch_dtype(config.dtype)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = config.block_size

    def block_view(self, which: str) -> torch.Tensor:
        """K or V as (layers, blocks, block_size, kv heads, head dim), sharing storage."""
        cache = self.k if which == "k" else self.v
        layers, slots, heads, dim = cache.shape
        return cache.view(layers, slots // self.block_size, self.block_size, heads, dim)


@dataclass(frozen=True)
class PrefillSpan:
    """Rows `start:end` of the batch are new tokens of one sequence with this context."""

    start: int
    end: int
    context_slots: torch.Tensor  # slots of positions 0 .. last new position
    first_position: int


@dataclass(frozen=True)
class AttentionPlan:
    """How the rows of one step's batch attend to the cache."""

    decode_rows: torch.Tensor | None  # (Bd,) batch rows that are single-token decodes
    decode_slots: torch.Tensor | None  # (Bd, Lmax) context slots, padded
    decode_mask: torch.Tensor | None  # (Bd, Lmax) True where the slot is real context
    prefills: tuple[PrefillSpan, ...]


class TinyTransformer:
    """Weights and the forward pass; no scheduling state lives here."""

    def __init__(self, config: EngineConfig, seed: int, device: torch.device,
                 favoured_ids: list[int]) -> None:
        assert config.vocab_size is not None, "the engine resolves the vocabulary size"
        self.vocab_size = config.vocab_size
        self.favoured_ids = favoured_ids
        self.config = config
        self.seed = seed
        self.device = device
        self.dtype = torch_dtype(config.dtype)
        self._build()

    def _build(self) -> None:
        c = self.config
        gen = torch.Generator().manual_seed(self.seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float32) / math.sqrt(rows)
            return w.to(device=self.device, dtype=self.dtype)

        q_width = c.n_heads * c.head_dim
        kv_width = c.n_kv_heads * c.head_dim
        self.embed = torch.randn(self.vocab_size, c.d_model, generator=gen).to(
            device=self.device, dtype=self.dtype)
        self.layers = [
            {
                "wqkv": weight(c.d_model, q_width + 2 * kv_width),
                "wo": weight(q_width, c.d_model),
                "w_gate_up": weight(c.d_model, 2 * c.ffn_dim),
                "w_down": weight(c.ffn_dim, c.d_model),
                "attn_norm": torch.ones(c.d_model, dtype=self.dtype, device=self.device),
                "ffn_norm": torch.ones(c.d_model, dtype=self.dtype, device=self.device),
            }
            for _ in range(c.n_layers)
        ]
        self.final_norm = torch.ones(c.d_model, dtype=self.dtype, device=self.device)
        # Untied output head (a tied one makes every token predict itself), scaled so
        # that logits have a standard deviation of about `logit_scale`.
        self.lm_head = (torch.randn(c.d_model, self.vocab_size, generator=gen)
                        * (c.logit_scale / math.sqrt(c.d_model))).to(
            device=self.device, dtype=self.dtype)
        # Favour printable ASCII tokens (and newlines) so that outputs read as text, not
        # raw bytes or halves of characters.
        self.logit_bias = torch.zeros(self.vocab_size, dtype=torch.float32)
        self.logit_bias[self.favoured_ids] = c.ascii_bias
        self.logit_bias = self.logit_bias.to(self.device)
        half = c.head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(c.max_model_len, dtype=torch.float64), inv_freq)
        self.cos = angles.cos().to(device=self.device, dtype=self.dtype)
        self.sin = angles.sin().to(device=self.device, dtype=self.dtype)

    def to(self, device: torch.device) -> None:
        """Move every weight to `device` (sleep offloads, wake brings back)."""
        self.device = device
        self.embed = self.embed.to(device)
        self.lm_head = self.lm_head.to(device)
        self.logit_bias = self.logit_bias.to(device)
        self.final_norm = self.final_norm.to(device)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self.layers = [{k: v.to(device) for k, v in layer.items()} for layer in self.layers]

    def drop(self) -> None:
        """Free the weights (sleep level 2); `rebuild` regenerates them from the seed."""
        self.layers = []
        self.embed = self.lm_head = self.final_norm = torch.empty(0)

    def rebuild(self) -> None:
        """Regenerate the weights from the seed after `drop`."""
        self._build()

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def forward(  # noqa: PLR0917 (one tensor per role; called from one place)
        self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
        plan: AttentionPlan, pool: KVPool, logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run the new tokens, write their K/V at `write_slots`, return float32 logits.

        `logit_rows` picks the rows whose next-token logits are wanted (the last
        new token of each sequence).
        """
        c = self.config
        n = tokens.shape[0]
        heads, kv_heads, dim = c.n_heads, c.n_kv_heads, c.head_dim
        group = heads // kv_heads
        scale = 1.0 / math.sqrt(dim)
        x = self.embed[tokens]
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["attn_norm"])
            qkv = h @ layer["wqkv"]
            q = qkv[:, : heads * dim].view(n, heads, dim)
            k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
            q = self._rope(q, positions)
            k = self._rope(k, positions)
            k_cache, v_cache = pool.k[index], pool.v[index]
            k_cache[write_slots] = k
            v_cache[write_slots] = v
            out = torch.empty(n, heads, dim, dtype=x.dtype, device=x.device)
            if plan.decode_rows is not None:
                assert plan.decode_slots is not None
                assert plan.decode_mask is not None
                rows = plan.decode_rows
                bd = rows.shape[0]
                qd = q[rows].view(bd, kv_heads, group, dim)
                kd = k_cache[plan.decode_slots].permute(0, 2, 3, 1)  # (Bd, KV, D, L)
                vd = v_cache[plan.decode_slots].permute(0, 2, 1, 3)  # (Bd, KV, L, D)
                scores = (qd @ kd) * scale  # (Bd, KV, G, L)
                scores = scores.masked_fill(~plan.decode_mask[:, None, None, :], -math.inf)
                out[rows] = (torch.softmax(scores, dim=-1) @ vd).view(bd, heads, dim)
            for span in plan.prefills:
                qp = q[span.start : span.end].view(-1, kv_heads, group, dim).permute(1, 2, 0, 3)
                kp = k_cache[span.context_slots].permute(1, 2, 0)  # (KV, D, L)
                vp = v_cache[span.context_slots].permute(1, 0, 2)  # (KV, L, D)
                scores = (qp @ kp.unsqueeze(1)) * scale  # (KV, G, n_new, L)
                n_new, length = span.end - span.start, span.context_slots.shape[0]
                query_pos = torch.arange(n_new, device=x.device) + span.first_position
                causal = torch.arange(length, device=x.device)[None, :] <= query_pos[:, None]
                scores = scores.masked_fill(~causal, -math.inf)
                attended = torch.softmax(scores, dim=-1) @ vp.unsqueeze(1)  # (KV, G, n_new, D)
                out[span.start : span.end] = attended.permute(2, 0, 1, 3).reshape(
                    n_new, heads, dim)
            x = x + out.view(n, heads * dim) @ layer["wo"]
            h = self._rms_norm(x, layer["ffn_norm"])
            gate, up = (h @ layer["w_gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w_down"]
        last = self._rms_norm(x[logit_rows], self.final_norm)
        return (last @ self.lm_head).float() + self.logit_bias
