"""The migrate-or-re-prefill cost model: byte counts, monotonicity, crossovers."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv.layout import KVGeometry, blocks_for_tokens
from dynamo_ftctl.migrate.cost import (
    LINKS,
    MODELS,
    Link,
    PrefillModel,
    crossovers,
    link_preset,
    model_preset,
    plan_migration,
    plan_table,
)

KIB = 1024


def test_llama3_70b_fp16_tp8_byte_counts() -> None:
    """Llama-3-70B fp16 TP=8: 320 KiB/token, 40 KiB/token/shard, 640 KiB per 16-token block."""
    plan = plan_migration(model_preset("llama-3-70b"), tp=8, tokens=32768, link=LINKS["nvlink4"])
    assert plan.kv_bytes_per_token == 320 * KIB
    assert plan.kv_bytes_per_token_per_shard == 40 * KIB
    assert plan.block_bytes_per_shard == 640 * KIB
    assert plan.kv_bytes_total == 32768 * 320 * KIB
    assert plan.kv_bytes_per_shard == 32768 * 40 * KIB
    assert plan.blocks == 2048
    assert all(isinstance(v, int) for v in (plan.kv_bytes_per_token, plan.kv_bytes_total,
                                             plan.block_bytes_per_shard))


def test_presets_match_published_geometry() -> None:
    """Per-token KV bytes of every preset match 2·layers·kv_heads·head_dim·2 (MLA: latent)."""
    assert MODELS["llama-3-8b"].geometry.bytes_per_token() == 128 * KIB
    assert MODELS["llama-3-405b"].geometry.bytes_per_token() == 2 * 126 * 8 * 128 * 2
    assert MODELS["mixtral-8x7b"].geometry.bytes_per_token() == 128 * KIB
    assert MODELS["qwen2.5-72b"].geometry.bytes_per_token() == 320 * KIB
    # DeepSeek-V3 MLA: 61 layers × (512 + 64) latent × 2 bytes, the same on every TP rank.
    ds = MODELS["deepseek-v3"].geometry
    assert ds.bytes_per_token() == 61 * 576 * 2 == 70272
    assert ds.bytes_per_token_per_shard(8) == 70272


def test_tp_beyond_kv_heads_replicates_heads() -> None:
    """With TP larger than the KV head count each shard keeps one head."""
    g = KVGeometry(layers=32, kv_heads=8, head_dim=128)
    assert g.bytes_per_token_per_shard(16) == 2 * 32 * 1 * 128 * 2
    with pytest.raises(InvalidInput, match="does not divide"):
        g.bytes_per_token_per_shard(3)
    with pytest.raises(InvalidInput, match="not a multiple"):
        g.bytes_per_token_per_shard(12)


def test_fp8_halves_the_bytes() -> None:
    """A KV dtype override scales every byte count."""
    fp8 = model_preset("llama-3-70b").with_dtype("fp8")
    assert fp8.geometry.bytes_per_token() == 160 * KIB
    with pytest.raises(InvalidInput, match="unknown KV dtype"):
        model_preset("llama-3-70b").with_dtype("fp7")


def test_unknown_names_list_the_known_ones() -> None:
    """Misspelt model or link names fail with the list of presets."""
    with pytest.raises(InvalidInput, match="llama-3-70b"):
        model_preset("llama-70b")
    with pytest.raises(InvalidInput, match="nvlink4"):
        link_preset("nvlink9")


def test_nvlink_beats_reprefill_and_tcp_loses_at_long_context() -> None:
    """On NVLink a 32k-token 70B context moves faster than re-prefill; on TCP only past ~200k."""
    m = model_preset("llama-3-70b")
    plan = plan_migration(m, tp=8, tokens=32768, link=LINKS["nvlink4"])
    assert plan.decision == "kv"
    assert plan.transfer_s == pytest.approx(1e-4 + 32768 * 40 * KIB / 450e9)
    tcp = plan_migration(m, tp=8, tokens=32768, link=LINKS["tcp"])
    assert tcp.decision == "reprefill"
    (n,) = tcp.crossover_tokens  # the n² attention term catches up with the slow link
    assert 100_000 < n < 400_000
    assert plan_migration(m, tp=8, tokens=n, link=LINKS["tcp"]).decision == "kv"
    assert plan_migration(m, tp=8, tokens=n - 1, link=LINKS["tcp"]).decision == "reprefill"


def test_blocks_round_up() -> None:
    """A partly filled last block still counts as a block."""
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(1, 16) == 1
    assert blocks_for_tokens(16, 16) == 1
    assert blocks_for_tokens(17, 16) == 2


def test_table_covers_contexts_times_links() -> None:
    """The table has one plan per (context, link), contexts outer."""
    tab = plan_table(model_preset("llama-3-8b"), tp=1, contexts=(1024, 4096),
                     links=[LINKS["nvlink4"], LINKS["tcp"]])
    assert [(p.tokens, p.link) for p in tab.plans] == [
        (1024, "nvlink4"), (1024, "tcp"), (4096, "nvlink4"), (4096, "tcp")]
    assert tab.to_json()["plans"][3]["kv_bytes_per_token"] == 128 * KIB


prefills = st.builds(
    PrefillModel,
    per_token_s=st.floats(1e-7, 1e-2),
    per_token2_s=st.floats(0, 1e-8),
    fixed_s=st.floats(0, 0.1),
)
links = st.builds(
    Link, name=st.just("x"), bandwidth=st.floats(1e8, 1e12), setup_s=st.floats(0, 0.1),
    per_gpu=st.booleans(),
)
models = st.sampled_from(sorted(MODELS))


@settings(max_examples=200, deadline=None)
@given(model=models, prefill=prefills, link=links, tokens=st.integers(0, 500_000),
       more=st.integers(1, 100_000), tp=st.sampled_from([1, 2, 4, 8]))
def test_costs_grow_with_context(model: str, prefill: PrefillModel, link: Link, tokens: int,
                                 more: int, tp: int) -> None:
    """Bytes, transfer time and re-prefill time never shrink as the context grows."""
    m = MODELS[model]
    a = plan_migration(m, tp=tp, tokens=tokens, link=link, prefill=prefill)
    b = plan_migration(m, tp=tp, tokens=tokens + more, link=link, prefill=prefill)
    assert b.kv_bytes_total > a.kv_bytes_total
    assert b.transfer_s >= a.transfer_s
    assert b.reprefill_s >= a.reprefill_s
    if m.geometry.is_latent:
        assert a.kv_bytes_per_shard == a.kv_bytes_total  # the latent is not split
    else:
        assert a.kv_bytes_per_shard <= a.kv_bytes_total <= a.kv_bytes_per_shard * tp


@settings(max_examples=300, deadline=None)
@given(model=models, prefill=prefills, link=links, tp=st.sampled_from([1, 2, 8]))
def test_decision_flips_exactly_at_the_crossovers(
    model: str, prefill: PrefillModel, link: Link, tp: int,
) -> None:
    """Between crossovers the decision is constant; across each one it flips."""
    m = MODELS[model]
    plan = plan_migration(m, tp=tp, tokens=1, link=link, prefill=prefill)
    per_link = plan.kv_bytes_per_token_per_shard if link.per_gpu else plan.kv_bytes_per_token
    roots = crossovers(prefill, link.setup_s, per_link / link.bandwidth)
    assume(all(1e-3 < r < 1e9 for r in roots))
    assume(all(abs(b - a) > 2e-3 * b for a, b in itertools.pairwise(roots)))

    def decide(n: float) -> str:
        t = link.setup_s + n * per_link / link.bandwidth
        return "kv" if t < prefill.time(n) else "reprefill"

    points = [0.0, *roots]
    for low, high in zip(points, [*roots, math.inf], strict=True):
        mid = (low + high) / 2 if math.isfinite(high) else max(2 * low, 1.0)
        inside = decide(mid)
        # Just inside either end of the interval, the same decision holds.
        if low > 0:
            assert decide(low * (1 + 1e-3)) == inside
        if math.isfinite(high):
            assert decide(high * (1 - 1e-3)) == inside
            assert decide(high * (1 + 1e-3)) != inside


def test_setup_cost_creates_a_crossover() -> None:
    """A transfer setup above the prefill fixed cost makes re-prefill win for short contexts."""
    prefill = PrefillModel(per_token_s=1e-4)
    link = Link("x", bandwidth=1e9, setup_s=0.01, per_gpu=True)
    m = model_preset("llama-3-8b")  # 128 KiB/token → 1.31e-4 s/token at 1 GB/s: never wins
    assert plan_migration(m, tp=1, tokens=100, link=link, prefill=prefill).crossover_tokens == ()
    fast = Link("y", bandwidth=1e10, setup_s=0.01, per_gpu=True)  # 1.31e-5 s/token
    plan = plan_migration(m, tp=1, tokens=100, link=fast, prefill=prefill)
    n = 0.01 / (1e-4 - 128 * KIB / 1e10)
    assert plan.crossover_tokens == (math.ceil(n),)
    assert plan.decision == "reprefill"
    assert plan_migration(m, tp=1, tokens=math.ceil(n), link=fast, prefill=prefill).decision == "kv"


def test_prefill_from_flops_is_quadratic_in_context() -> None:
    """The FLOP prefill model for 70B on 8 H100s: linear weights term plus an n² attention term."""
    m = model_preset("llama-3-70b")
    p = PrefillModel.from_flops(m, 8, __import__("dynamo_ftctl.migrate.cost",
                                                  fromlist=["GPUS"]).GPUS["h100"], 0.5)
    assert p.per_token_s == pytest.approx(2 * 70.6e9 / (8 * 989e12 * 0.5))
    assert p.per_token2_s == pytest.approx(80 * 64 * 256 / (8 * 989e12 * 0.5))
    assert p.time(2000) - 2 * p.time(1000) == pytest.approx(2e6 * p.per_token2_s)
