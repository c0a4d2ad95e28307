"""Cache-aware routing: the bounded prefix index, longest-prefix choice, load balance."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.inventory.proxy import CacheAware, ProxyConfig
from dynamo_ftctl.proxy.balancer import Balancer, WorkerSlot
from dynamo_ftctl.proxy.ledger import StreamLedger
from dynamo_ftctl.proxy.prefix import (
    BLOCK_TOKENS,
    PrefixIndex,
    prefix_key,
    text_key,
    token_key,
)
from dynamo_ftctl.structs import convert_struct

WORKERS = ("w0", "w1", "w2", "w3")
# Prompts made of three distinct blocks and a partial tail share long prefixes often.
_BLOCKS = tuple([b] * BLOCK_TOKENS for b in range(3))
ids = st.builds(lambda blocks, tail: [t for b in blocks for t in _BLOCKS[b]] + tail,
                st.lists(st.integers(0, 2), max_size=6),
                st.lists(st.integers(0, 2), max_size=BLOCK_TOKENS - 1))


def make(clock: FakeClock | None = None, *, threshold: float = 0.3, abs_: int = 64,
         rel: float = 1.5, entries: int = 1 << 20, groups: tuple[str, ...] = ()) -> Balancer:
    slots = [WorkerSlot(name=n, url=f"http://127.0.0.1:{9000 + i}",
                        group=groups[i] if groups else n, model="m")
             for i, n in enumerate(WORKERS)]
    return Balancer(slots, clock=clock or FakeClock(), cache_aware=CacheAware(
        cache_threshold=threshold, balance_abs_threshold=abs_, balance_rel_threshold=rel,
        max_entries=entries))


def common_blocks(a: list[int], b: list[int]) -> int:
    """Full blocks `a` and `b` share from the start (the brute-force oracle)."""
    n = 0
    while (n + 1) * BLOCK_TOKENS <= min(len(a), len(b)) \
            and a[n * BLOCK_TOKENS:(n + 1) * BLOCK_TOKENS] == b[n * BLOCK_TOKENS:(n + 1) * BLOCK_TOKENS]:
        n += 1
    return n


def check_counts(index: PrefixIndex) -> None:
    blocks: dict[int, list[str]] = index._blocks
    assert len(index) == sum(len(w) for w in blocks.values())
    for worker in WORKERS:
        assert index.held_by(worker) == sum(worker in w for w in blocks.values())
    assert all(blocks.values())  # no empty block is kept


@settings(max_examples=150, deadline=None)
@given(bound=st.integers(1, 40),
       ops=st.lists(st.tuples(st.sampled_from(("insert", "insert", "insert", "forget")),
                              st.sampled_from(WORKERS), ids), max_size=60))
def test_index_stays_within_its_bound_under_any_sequence(
        bound: int, ops: list[tuple[str, str, list[int]]]) -> None:
    """Whatever is inserted or forgotten, the index holds at most its bound of (block,
    worker) pairs, and its per-worker counts match what it holds."""
    index = PrefixIndex(bound)
    for op, worker, seq in ops:
        if op == "insert":
            index.insert(token_key("m", seq), worker)
        else:
            index.forget(worker)
        assert len(index) <= bound
        assert index.blocks <= bound
        check_counts(index)


def test_index_memory_is_bounded_in_bytes() -> None:
    """Ten times its bound of distinct long prompts leave the index within 300
    bytes a pair (the settings document about 250)."""
    bound = 4096
    tracemalloc.start()
    try:
        index = PrefixIndex(bound)
        base = tracemalloc.get_traced_memory()[0]
        for i in range(10 * bound // 8):
            index.insert(token_key("m", [i] * (8 * BLOCK_TOKENS)), WORKERS[i % 4])
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(index) == bound
    assert used / bound < 300


def test_eviction_takes_leaves_before_roots() -> None:
    """Past the bound, a prompt's deepest blocks go first: its start still matches."""
    index = PrefixIndex(4)
    index.insert(token_key("m", list(range(6 * BLOCK_TOKENS))), "w0")
    assert index.match(token_key("m", list(range(6 * BLOCK_TOKENS)))) == {"w0": 4}


@settings(max_examples=150, deadline=None)
@given(served=st.lists(st.tuples(st.sampled_from(WORKERS), ids), max_size=12), query=ids)
def test_match_is_each_workers_longest_served_prefix(
        served: list[tuple[str, list[int]]], query: list[int]) -> None:
    """With room for everything, each worker matches the longest full-block prefix of the
    query that any prompt it served shares (a brute-force oracle)."""
    index = PrefixIndex(1 << 20)
    for worker, seq in served:
        index.insert(token_key("m", seq), worker)
    expected: dict[str, int] = {}
    for worker, seq in served:
        expected[worker] = max(expected.get(worker, 0), common_blocks(seq, query))
    assert index.match(token_key("m", query)) == {w: n for w, n in expected.items() if n}


@settings(max_examples=150, deadline=None)
@given(served=st.lists(st.tuples(st.sampled_from(WORKERS), ids), max_size=12),
       query=ids,
       loads=st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_balanced_fleet_picks_the_longest_prefix(
        served: list[tuple[str, list[int]]], query: list[int], loads: list[int]) -> None:
    """While the load is in balance, the chosen worker holds the longest prefix of the
    prompt when it is over the threshold (0 here: any block), else the fewest blocks."""
    router = make(threshold=0.0)
    index = router.prefixes
    assert index is not None
    for worker, seq in served:
        index.insert(token_key("m", seq), worker)
    for name, load in zip(WORKERS, loads, strict=True):
        router.slots[name].outstanding = load
    held = index.match(token_key("m", query))
    fewest = min(index.held_by(w) for w in WORKERS)
    slot = router.pick_by_prefix(token_key("m", query), model="m")
    assert slot is not None
    if held:
        assert held.get(slot.name, 0) == max(held.values())
    else:
        assert index.held_by(slot.name) >= fewest  # it holds the prompt now
    assert index.match(token_key("m", query)).get(slot.name, 0) == len(query) // BLOCK_TOKENS


def test_a_conversation_stays_on_its_worker_and_new_ones_spread() -> None:
    """Turns of one conversation follow its first; a second conversation goes to the
    worker holding fewer prefixes."""
    router = make()
    first = list(range(4 * BLOCK_TOKENS))
    a = router.pick_by_prefix(token_key("m", first), model="m")
    b = router.pick_by_prefix(token_key("m", [7] * 64), model="m")
    assert a is not None
    assert b is not None
    assert a is not b
    for turn in range(1, 5):
        longer = first + [100 + turn] * (turn * BLOCK_TOKENS)
        a.outstanding = turn  # busier than the rest, within the balance thresholds
        assert router.pick_by_prefix(token_key("m", longer), model="m") is a


def test_short_match_below_threshold_goes_to_the_emptiest_cache() -> None:
    """A prefix of at most cache_threshold of the prompt draws nothing."""
    router = make(threshold=0.5)
    router.remember(token_key("m", list(range(2 * BLOCK_TOKENS))), router.slots["w0"])
    router.remember(token_key("m", [9] * 64), router.slots["w1"])
    router.remember(token_key("m", [8] * 64), router.slots["w2"])
    query = list(range(2 * BLOCK_TOKENS)) + [5] * (2 * BLOCK_TOKENS)  # w0 holds half
    slot = router.pick_by_prefix(token_key("m", query), model="m")
    assert slot is router.slots["w3"]


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(st.integers(0, 200), min_size=4, max_size=4),
       abs_=st.integers(0, 100), rel=st.floats(1.0, 4.0))
def test_imbalance_hands_the_choice_to_least_outstanding(
        loads: list[int], abs_: int, rel: float) -> None:
    """Past both thresholds (max - min > abs and max > rel * min) the least loaded worker
    wins whoever holds the prefix; within them, the prefix's holder does."""
    router = make(abs_=abs_, rel=rel)
    key = token_key("m", list(range(4 * BLOCK_TOKENS)))
    router.remember(key, router.slots["w0"])
    for name, load in zip(WORKERS, loads, strict=True):
        router.slots[name].outstanding = load
    slot = router.pick_by_prefix(key, model="m")
    assert slot is not None
    high, low = max(loads), min(loads)
    if high - low > abs_ and high > rel * low:
        assert slot.outstanding == low
    else:
        assert slot.name == "w0"


@settings(max_examples=200, deadline=None)
@given(state=st.lists(st.tuples(st.sampled_from(("ok", "open", "absent", "spared", "busy")),
                                st.booleans()), min_size=4, max_size=4),
       served=st.lists(st.tuples(st.sampled_from(WORKERS), ids), max_size=8), query=ids,
       last_resort=st.booleans())
def test_dead_excluded_or_spared_workers_are_never_chosen(
        state: list[tuple[str, bool]], served: list[tuple[str, list[int]]],
        query: list[int], last_resort: bool) -> None:
    """An open breaker, an absent or spared worker, or one the request failed on is not
    chosen while a live one is left; a busy one only when every live one is busy."""
    clock = FakeClock()
    router = make(clock, threshold=0.0)
    for worker, seq in served:
        router.remember(token_key("m", seq), router.slots[worker])
    excluded: set[str] = set()
    for name, (what, failed) in zip(WORKERS, state, strict=True):
        slot = router.slots[name]
        if what == "open":
            slot.breaker, slot.opened_at = "open", clock.now()
        elif what == "absent":
            slot.absent = True
        elif what == "spared":
            slot.spared_until = clock.now() + 10
        elif what == "busy":
            slot.busy = True
        if failed:
            excluded.add(name)
    chosen = router.pick_by_prefix(token_key("m", query), model="m", exclude_workers=excluded,
                                   last_resort=last_resort)
    live = [s for s in router.slots.values()
            if s.name not in excluded and router.weight(s) > 0]
    if chosen is None:
        assert not live
        return
    assert chosen.name not in excluded
    if live:
        assert router.weight(chosen) > 0
        if any(not s.busy for s in live):
            assert not chosen.busy
    else:
        assert last_resort
        assert not chosen.absent


def test_continuation_prefers_the_worker_holding_prompt_and_output() -> None:
    """After a cut, the continuation goes to the live worker holding the longest prefix of
    prompt + generated ids, never the one that failed."""
    router = make(groups=("a", "b", "c", "d"))
    prompt = list(range(3 * BLOCK_TOKENS))
    generated = [500 + i for i in range(2 * BLOCK_TOKENS)]
    router.remember(token_key("m", prompt + generated), router.slots["w0"])  # failed one
    router.remember(token_key("m", prompt + generated[:BLOCK_TOKENS]), router.slots["w2"])
    router.remember(token_key("m", prompt), router.slots["w1"])
    ledger = StreamLedger("completions", {"model": "m", "prompt": prompt})
    ledger.generated_ids = generated
    ledger.generated_count = len(generated)
    slot = router.pick_by_prefix(prefix_key(ledger, "m"), model="m", exclude_workers={"w0"},
                                 exclude_groups={"a"}, avoid_busy=False, last_resort=True)
    assert slot is router.slots["w2"]


def test_open_breaker_and_reload_forget_a_worker() -> None:
    """A worker whose breaker opens, or that a reload removes, holds nothing in the index."""
    router = make()
    index = router.prefixes
    assert index is not None
    key = token_key("m", list(range(2 * BLOCK_TOKENS)))
    for name in WORKERS:
        router.remember(key, router.slots[name])
    for _ in range(3):
        router.record_failure(router.slots["w0"])
    assert index.held_by("w0") == 0
    router.replace_slots([s for s in router.slots.values() if s.name != "w1"])
    assert index.held_by("w1") == 0
    assert index.match(key) == {"w2": 2, "w3": 2}


def test_least_outstanding_router_keeps_no_index() -> None:
    """Without cache-aware settings there is no index and `pick_by_prefix` is `pick`."""
    router = Balancer([WorkerSlot(name="w0", url="http://x", group="a", model="m")])
    assert router.prefixes is None
    assert router.pick_by_prefix(token_key("m", list(range(32))), model="m") is not None


chat_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(("system", "user")),
    "content": st.one_of(st.text(max_size=80),
                         st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                         "text": st.text(max_size=40)}),
                                  max_size=2))}), min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(messages=chat_messages, reply=st.text(max_size=200), user=st.text(max_size=80))
def test_a_chat_turns_key_extends_the_last_turns(
        messages: list[dict[str, Any]], reply: str, user: str) -> None:
    """The key of a finished turn (messages and reply) is a prefix of the next turn's
    (those messages, the reply as an assistant message, a new user message)."""
    done = StreamLedger("chat", {"model": "m", "messages": messages})
    done.observe({"choices": [{"index": 0, "delta": {"content": reply}}]})
    finished = prefix_key(done, "m")
    following = [*messages, {"role": "assistant", "content": reply},
                 {"role": "user", "content": user}]
    nxt = prefix_key(StreamLedger("chat", {"model": "m", "messages": following}), "m")
    assert finished is not None
    assert nxt is not None
    assert nxt.blocks[:len(finished.blocks)] == finished.blocks


def test_text_and_id_keys_never_meet_and_models_apart() -> None:
    """A text key and an id key, or two models' keys, share no block."""
    text = "a" * 128
    assert not set(text_key("m", text).blocks) & set(token_key("m", [97] * 128).blocks)
    assert not set(text_key("m", text).blocks) & set(text_key("n", text).blocks)


def test_unknown_routing_is_refused_naming_its_key() -> None:
    """`routing: bogus` is an inventory error that names the key."""
    with pytest.raises(InventoryError, match="routing"):
        convert_struct({"routing": "bogus"}, ProxyConfig)
