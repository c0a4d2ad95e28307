"""Migrate by KV transfer or by re-prefill? The cost model that decides.

Both ways of moving a request send one continuation request to the new
worker; they differ in how its KV cache gets there:

- **KV transfer**: `setup_s + bytes / bandwidth`, where a link moves the
  blocks of one tensor-parallel shard when every GPU has its own link
  (NVLink, PCIe, one InfiniBand NIC per GPU: shards move in parallel), and the
  whole model's unique bytes when the host shares one link (TCP).
- **re-prefill**: `fixed_s + n·per_token_s + n²·per_token2_s` for a context of
  n tokens: a linear term from the weights (2 FLOPs per active parameter per
  token) and an attention term that grows with the square of the context
  (QKᵀ and AV over the causal half of the n² pairs).

The decision is whichever is faster (ties go to re-prefill, which needs no
export support). Setting the two equal gives a quadratic in n whose positive
roots are the crossover context lengths: with a transfer setup cost larger
than the prefill fixed cost, re-prefill wins below the first root; on a slow
link the quadratic attention term can bring re-prefill back above a second.

Transfer bytes count tokens, not whole blocks: a partly filled last block adds
less than one block (reported as `blocks`/`block_bytes_per_shard`).

Pure arithmetic: no torch, no I/O. `migrate/calibrate.py` replaces the
preset rates with measured ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv.layout import KVGeometry, blocks_for_tokens, dtype_bytes

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.console import Group

__all__ = [
    "GPUS",
    "LINKS",
    "MODELS",
    "GpuPreset",
    "Link",
    "MigrationPlan",
    "ModelPreset",
    "PlanTable",
    "PrefillModel",
    "PrefillReuse",
    "crossovers",
    "link_preset",
    "model_preset",
    "plan_migration",
    "plan_table",
    "prefill_reuse",
]

Method = Literal["kv", "reprefill"]


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV geometry and what its prefill costs in FLOPs."""

    name: str
    geometry: KVGeometry
    q_heads: int
    # Per attention head: query-key dim + value dim (GQA: 2 × head_dim; MLA: 192 + 128).
    attn_dim: int
    active_params: float
    source: str

    def with_dtype(self, name: str) -> ModelPreset:
        """The same model with its KV cache in another dtype."""
        return replace(self, geometry=replace(self.geometry, dtype_bytes=dtype_bytes(name)))


# Geometries from each model's published config.json (num_hidden_layers,
# num_key_value_heads, head_dim; DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64).
MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset("llama-3-8b", KVGeometry(32, 8, 128), 32, 256, 8.03e9,
                    "meta-llama/Meta-Llama-3-8B"),
        ModelPreset("llama-3-70b", KVGeometry(80, 8, 128), 64, 256, 70.6e9,
                    "meta-llama/Meta-Llama-3-70B"),
        ModelPreset("llama-3-405b", KVGeometry(126, 8, 128), 128, 256, 405.9e9,
                    "meta-llama/Llama-3.1-405B"),
        ModelPreset("mixtral-8x7b", KVGeometry(32, 8, 128), 32, 256, 12.9e9,
                    "mistralai/Mixtral-8x7B-v0.1 (12.9B of 46.7B parameters active)"),
        ModelPreset("qwen2.5-72b", KVGeometry(80, 8, 128), 64, 256, 72.7e9,
                    "Qwen/Qwen2.5-72B"),
        ModelPreset("deepseek-v3", KVGeometry(61, 1, 576, latent_dim=576), 128, 320, 37e9,
                    "deepseek-ai/DeepSeek-V3 (MLA latent 512+64; 37B of 671B active)"),
    )
}


@dataclass(frozen=True)
class Link:
    """One direction of an interconnect, as a migration uses it."""

    name: str
    bandwidth: float  # bytes/s, per direction
    setup_s: float  # per transfer: handshake, registration, launch
    per_gpu: bool  # True: each TP shard has its own link (shards move in parallel)
    description: str = ""


# Per-direction figures (docs/design.md "Cost model"): the often-quoted NVLink 4 "900 GB/s" counts
# both directions. Setup latencies are assumptions: `ftctl migrate calibrate`
# measures the real one.
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("nvlink3", 300e9, 1e-4, per_gpu=True, description="A100 NVLink 3"),
        Link("nvlink4", 450e9, 1e-4, per_gpu=True, description="H100 NVLink 4"),
        Link("nvlink5", 900e9, 1e-4, per_gpu=True, description="B200 NVLink 5"),
        Link("pcie4", 25e9, 1e-4, per_gpu=True, description="PCIe 4 x16, achievable"),
        Link("pcie5", 50e9, 1e-4, per_gpu=True, description="PCIe 5 x16, achievable"),
        Link("ib-ndr", 50e9, 5e-4, per_gpu=True, description="InfiniBand NDR 400 Gb/s per GPU"),
        Link("ib-xdr", 100e9, 5e-4, per_gpu=True, description="InfiniBand XDR 800 Gb/s per GPU"),
        Link("tcp", 3.125e9, 2e-3, per_gpu=False, description="TCP over 25 GbE, one per host"),
    )
}


@dataclass(frozen=True)
class GpuPreset:
    """Dense 16-bit tensor throughput of one GPU, for the FLOP-derived prefill model."""

    name: str
    flops: float


GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("a100", 312e12), GpuPreset("h100", 989e12), GpuPreset("h200", 989e12),
        GpuPreset("b200", 2250e12),
    )
}

# Prefill reaches about half of peak on current engines (long prompts, large batches).
DEFAULT_MFU = 0.5


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill n tokens: fixed + n × per_token + n² × per_token2."""

    per_token_s: float
    per_token2_s: float = 0.0
    fixed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.per_token_s < 0 or self.per_token2_s < 0 or self.fixed_s < 0:
            msg = "prefill model terms must be >= 0"
            raise InvalidInput(msg)
        if self.per_token_s == 0 and self.per_token2_s == 0:
            msg = "a prefill model needs a per-token or an attention term"
            raise InvalidInput(msg)

    def time(self, tokens: float) -> float:
        """Seconds to prefill `tokens` tokens."""
        return self.fixed_s + tokens * self.per_token_s + tokens * tokens * self.per_token2_s

    @property
    def tokens_per_s(self) -> float:
        """Throughput of the linear term alone (short prompts)."""
        return math.inf if self.per_token_s == 0 else 1.0 / self.per_token_s

    @classmethod
    def from_flops(
        cls, model: ModelPreset, tp: int, gpu: GpuPreset, mfu: float = DEFAULT_MFU,
    ) -> PrefillModel:
        """The prefill model implied by FLOPs on `tp` GPUs at `mfu` of peak."""
        if not 0 < mfu <= 1:
            msg = f"MFU must be in (0, 1] (got {mfu})"
            raise InvalidInput(msg)
        rate = tp * gpu.flops * mfu
        attention = model.geometry.layers * model.q_heads * model.attn_dim
        return cls(per_token_s=2 * model.active_params / rate, per_token2_s=attention / rate)


def model_preset(name: str) -> ModelPreset:
    """A model preset by name (InvalidInput naming the known ones otherwise)."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        msg = f"unknown model {name!r} (known: {', '.join(MODELS)})"
        raise InvalidInput(msg) from None


def link_preset(name: str) -> Link:
    """A link preset by name (InvalidInput naming the known ones otherwise)."""
    try:
        return LINKS[name.lower()]
    except KeyError:
        msg = f"unknown link {name!r} (known: {', '.join(LINKS)})"
        raise InvalidInput(msg) from None


def crossovers(
    prefill: PrefillModel, setup_s: float, seconds_per_token: float,
) -> tuple[float, ...]:
    """Positive context lengths where re-prefill time equals transfer time, ascending.

    Solves q·n² + (l − c)·n + (f − s) = 0 for prefill (f, l, q) and transfer
    (setup s, c seconds per token). Between consecutive roots the faster
    method is constant.
    """
    a = prefill.per_token2_s
    b = prefill.per_token_s - seconds_per_token
    c = prefill.fixed_s - setup_s
    roots: list[float]
    if a == 0:
        roots = [] if b == 0 else [-c / b]
    else:
        disc = b * b - 4 * a * c
        if disc < 0:
            roots = []
        else:
            sq = math.sqrt(disc)
            # The numerically stable pair (no cancellation between -b and sq).
            q = -0.5 * (b + math.copysign(sq, b)) if b != 0 else -0.5 * sq
            roots = [q / a, c / q] if q != 0 else [0.0]
    return tuple(sorted({r for r in roots if r > 0 and math.isfinite(r)}))


@dataclass(frozen=True)
class PrefillReuse:
    """How a continued stream's new worker got the KV of its prompt: `loaded + recomputed`
    is the prompt; `method` is "kv" when some of it came from outside the worker."""

    method: Method
    loaded: int
    recomputed: int


def prefill_reuse(prompt_tokens: int, cached_tokens: int, own_tokens: int) -> PrefillReuse:
    """Judge a continuation from the new worker's usage: of its `prompt_tokens` (the client's
    prompt and the tokens generated before the cut), `cached_tokens` were not computed
    (vLLM's `prompt_tokens_details.cached_tokens`: its prefix cache and a KV connector's
    loads together, one number).

    `own_tokens` is the most of this request's context the worker's own prefix cache can
    hold: the client's prompt (any request may have left it there) or what the worker
    reached on an earlier attempt of this request. Cached tokens beyond it came from
    elsewhere (a KV connector's store, an import): method "kv"; at most it, "reprefill",
    even where a connector loaded blocks the prefix cache could have given. All counts
    are clamped to [0, prompt_tokens]; never raises.
    """
    prompt = max(0, prompt_tokens)
    loaded = min(max(0, cached_tokens), prompt)
    method: Method = "kv" if loaded > max(0, own_tokens) else "reprefill"
    return PrefillReuse(method, loaded, prompt - loaded)


@dataclass(frozen=True)
class MigrationPlan:
    """Both costs of moving one request, the decision and the crossover points."""

    model: str
    dtype_bytes: int
    tp: int
    tokens: int
    block_size: int
    link: str
    bandwidth_bytes_per_s: float
    per_gpu_links: bool
    kv_bytes_per_token: int
    kv_bytes_per_token_per_shard: int
    kv_bytes_total: int
    kv_bytes_per_shard: int
    blocks: int
    block_bytes_per_shard: int
    transfer_bytes_per_link: int
    transfer_setup_s: float
    transfer_s: float
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_token2_s: float
    reprefill_s: float
    decision: Method
    speedup: float  # slower / faster
    crossover_tokens: tuple[int, ...]
    prefill_source: str = "flops"
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: byte counts as integers, times in seconds."""
        from dataclasses import asdict

        return asdict(self)

    def __rich__(self) -> Group:
        from rich.console import Group

        from dynamo_ftctl.output import kv_table

        summary = {
            "model": f"{self.model} ({self.dtype_bytes} B/elem), TP={self.tp}",
            "context": f"{self.tokens} tokens = {self.blocks} blocks of {self.block_size}",
            "KV per token": f"{_size(self.kv_bytes_per_token)} "
                            f"({_size(self.kv_bytes_per_token_per_shard)} per shard)",
            "KV per block per shard": _size(self.block_bytes_per_shard),
            "KV total": f"{_size(self.kv_bytes_total)} "
                        f"({_size(self.kv_bytes_per_shard)} per shard)",
            "link": f"{self.link}: {self.bandwidth_bytes_per_s / 1e9:g} GB/s per direction"
                    f"{', one per GPU' if self.per_gpu_links else ', shared'}",
            "KV transfer": f"{_ms(self.transfer_s)} ({_ms(self.transfer_setup_s)} setup)",
            "re-prefill": f"{_ms(self.reprefill_s)} ({self.prefill_source})",
            "decision": f"{self.decision} ({self.speedup:.3g}× faster)",
            "crossover": ", ".join(f"{n} tokens" for n in self.crossover_tokens) or "none",
        }
        return Group(kv_table("migration plan", summary), *self.notes)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"  # pragma: no cover


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms" if seconds < 10 else f"{seconds:.4g} s"


def plan_migration(
    model: ModelPreset,
    *,
    tp: int,
    tokens: int,
    link: Link,
    block_size: int = 16,
    prefill: PrefillModel | None = None,
    gpu: GpuPreset | None = None,
    mfu: float = DEFAULT_MFU,
    prefill_source: str | None = None,
) -> MigrationPlan:
    """Cost both ways of moving a request of `tokens` context tokens and pick one."""
    if tokens < 0:
        msg = f"tokens must be >= 0 (got {tokens})"
        raise InvalidInput(msg)
    if link.bandwidth <= 0 or link.setup_s < 0:
        msg = f"link {link.name}: bandwidth must be > 0 and setup >= 0"
        raise InvalidInput(msg)
    geometry = model.geometry
    per_token = geometry.bytes_per_token()
    per_shard = geometry.bytes_per_token_per_shard(tp)
    blocks = blocks_for_tokens(tokens, block_size)
    if prefill is None:
        prefill = PrefillModel.from_flops(model, tp, gpu or GPUS["h100"], mfu)
        source = prefill_source or f"FLOPs on {(gpu or GPUS['h100']).name} at {mfu:g} MFU"
    else:
        source = prefill_source or "given"
    # Per-GPU links move every shard at once; a shared link moves the unique bytes once.
    link_bytes_per_token = per_shard if link.per_gpu else per_token
    seconds_per_token = link_bytes_per_token / link.bandwidth
    transfer_s = link.setup_s + tokens * seconds_per_token
    reprefill_s = prefill.time(tokens)
    decision: Method = "kv" if transfer_s < reprefill_s else "reprefill"
    fast, slow = sorted((transfer_s, reprefill_s))
    speedup = slow / fast if fast > 0 else math.inf
    roots = crossovers(prefill, link.setup_s, seconds_per_token)
    notes = []
    if geometry.is_latent:
        notes.append("MLA: the latent cache is replicated on every TP rank, not split.")
    elif tp > geometry.kv_heads:
        notes.append(f"TP {tp} > {geometry.kv_heads} KV heads: heads are replicated.")
    return MigrationPlan(
        model=model.name,
        dtype_bytes=geometry.dtype_bytes,
        tp=tp,
        tokens=tokens,
        block_size=block_size,
        link=link.name,
        bandwidth_bytes_per_s=link.bandwidth,
        per_gpu_links=link.per_gpu,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_shard=per_shard,
        kv_bytes_total=tokens * per_token,
        kv_bytes_per_shard=tokens * per_shard,
        blocks=blocks,
        block_bytes_per_shard=geometry.block_bytes_per_shard(block_size, tp),
        transfer_bytes_per_link=tokens * link_bytes_per_token,
        transfer_setup_s=link.setup_s,
        transfer_s=transfer_s,
        prefill_fixed_s=prefill.fixed_s,
        prefill_per_token_s=prefill.per_token_s,
        prefill_per_token2_s=prefill.per_token2_s,
        reprefill_s=reprefill_s,
        decision=decision,
        speedup=speedup,
        crossover_tokens=tuple(math.ceil(r) for r in roots),
        prefill_source=source,
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class PlanTable:
    """Plans for a grid of context lengths × links."""

    model: str
    tp: int
    contexts: tuple[int, ...]
    links: tuple[str, ...]
    plans: tuple[MigrationPlan, ...]  # row-major: contexts outer, links inner

    def to_json(self) -> dict[str, Any]:
        """The grid as plain JSON."""
        return {
            "model": self.model, "tp": self.tp, "contexts": list(self.contexts),
            "links": list(self.links), "plans": [p.to_json() for p in self.plans],
        }

    def __rich__(self) -> Any:
        from dynamo_ftctl.output import table

        rows = []
        width = len(self.links)
        for i, tokens in enumerate(self.contexts):
            row: list[Any] = [tokens, _ms(self.plans[i * width].reprefill_s)]
            for plan in self.plans[i * width:(i + 1) * width]:
                cell = _ms(plan.transfer_s)
                row.append(cell if plan.decision == "kv" else f"({cell})")
            rows.append(row)
        out = table(
            f"{self.model}, TP={self.tp}: KV transfer time per link vs re-prefill",
            ["tokens", "re-prefill", *self.links], rows,
        )
        out.caption = "(parenthesised: re-prefill is faster than the transfer)"
        return out


DEFAULT_CONTEXTS = (128, 1024, 4096, 16384, 32768, 131072)


def plan_table(
    model: ModelPreset,
    *,
    tp: int,
    links: Sequence[Link] | None = None,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    block_size: int = 16,
    prefill: PrefillModel | None = None,
    gpu: GpuPreset | None = None,
    mfu: float = DEFAULT_MFU,
) -> PlanTable:
    """`plan_migration` for every context length × link."""
    chosen = tuple(links) if links else tuple(LINKS.values())
    plans = tuple(
        plan_migration(model, tp=tp, tokens=n, link=link, block_size=block_size,
                       prefill=prefill, gpu=gpu, mfu=mfu)
        for n in contexts for link in chosen
    )
    return PlanTable(model=model.name, tp=tp, contexts=tuple(contexts),
                     links=tuple(link.name for link in chosen), plans=plans)
