"""`cost.prefill_reuse`: whether a continuation's worker loaded KV from outside itself."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.migrate.cost import prefill_reuse

counts = st.integers(min_value=-5, max_value=1 << 20)


@given(counts, counts, counts)
def test_loaded_and_recomputed_make_the_prompt(prompt: int, cached: int, own: int) -> None:
    """Loaded + recomputed is the prompt (never negative), loaded at most the cached."""
    reuse = prefill_reuse(prompt, cached, own)
    assert reuse.loaded >= 0
    assert reuse.recomputed >= 0
    assert reuse.loaded + reuse.recomputed == max(0, prompt)
    assert reuse.loaded <= max(0, cached)


@given(counts, counts, counts)
def test_kv_exactly_when_more_was_cached_than_the_worker_could_hold(
        prompt: int, cached: int, own: int) -> None:
    """Method "kv" exactly when the tokens loaded exceed the worker's own context."""
    reuse = prefill_reuse(prompt, cached, own)
    assert (reuse.method == "kv") == (reuse.loaded > max(0, own))


@given(st.integers(min_value=1, max_value=1 << 16), st.integers(min_value=0, max_value=1 << 16))
def test_a_prefix_cache_hit_on_the_clients_prompt_is_no_kv_move(prompt: int, cached: int) -> None:
    """Cached tokens within the client's prompt (own = the prompt) are a re-prefill."""
    assert prefill_reuse(prompt, min(cached, prompt), prompt).method == "reprefill"


def test_examples() -> None:
    """A 1,100-token continued prompt of a 1,000-token client prompt, 1,024 cached."""
    assert prefill_reuse(1100, 1024, 1000) == prefill_reuse(1100, 1024, 0)
    assert prefill_reuse(1100, 1024, 1000).method == "kv"
    assert prefill_reuse(1100, 1024, 1000).recomputed == 76
    assert prefill_reuse(1100, 896, 1000).method == "reprefill"
    assert prefill_reuse(1100, 896, 1000).loaded == 896
