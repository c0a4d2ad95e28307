"""The connector's two halves without vLLM: the scheduler's plans, the worker's moves."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dynamo_ftctl.errors import InvalidInput  # noqa: E402
from dynamo_ftctl.kv.blockstore import BlockStore, chain_keys, namespace_key  # noqa: E402
from dynamo_ftctl.vllm_connector import _adapter  # noqa: E402
from dynamo_ftctl.vllm_connector._plan import BlockMove, Planner  # noqa: E402
from dynamo_ftctl.vllm_connector._worker import BlockMover  # noqa: E402

BS, NUM_BLOCKS, HEADS, DIM = 4, 16, 2, 8
NS = namespace_key("tiny", BS)


@dataclass
class FakeRequest:
    """The part of vLLM's Request the planner reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None


def cpu_cache(seed: int, layers: int = 3) -> dict[str, Any]:
    """vLLM CPU's per-layer layout: [num_blocks, heads, block_size, 2 * head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * DIM, generator=gen)
            for i in range(layers)}


def setup(tmp_path: Path, seed: int = 1) -> tuple[BlockStore, Planner, BlockMover, dict[str, Any]]:
    store = BlockStore(tmp_path / "store", 1 << 30)
    planner = Planner(store, NS, BS)
    mover = BlockMover(store)
    caches = cpu_cache(seed)
    mover.register(caches, NUM_BLOCKS)
    return store, planner, mover, caches


def step_saves(planner: Planner, request: FakeRequest, block_ids: list[int]) -> list[BlockMove]:
    return planner.plan([request.request_id], lambda _: block_ids).saves


def test_blocks_are_saved_the_step_after_they_fill(tmp_path: Path) -> None:
    """A block is planned for saving once the computed tokens with known ids cover it,
    once; a partial block never."""
    _, planner, _, _ = setup(tmp_path)
    req = FakeRequest("a", list(range(10)))
    planner.track(req)
    assert step_saves(planner, req, [5, 6, 7]) == []
    req.num_computed_tokens = 9
    saves = step_saves(planner, req, [5, 6, 7])
    assert [m.block_id for m in saves] == [5, 6]
    assert [m.key for m in saves] == chain_keys(NS, req.all_token_ids, BS)
    assert step_saves(planner, req, [5, 6, 7]) == []
    req.all_token_ids += [10, 11]
    req.num_computed_tokens = 12
    assert [m.block_id for m in step_saves(planner, req, [5, 6, 7])] == [7]


def test_async_scheduling_lag_saves_only_blocks_whose_ids_are_known(tmp_path: Path) -> None:
    """Computed tokens ahead of the known ids (async scheduling) do not save a block
    whose ids are not all known yet."""
    _, planner, _, _ = setup(tmp_path)
    req = FakeRequest("a", list(range(7)), num_computed_tokens=8)
    planner.track(req)
    assert [m.block_id for m in step_saves(planner, req, [1, 2])] == [1]


def test_a_continuation_loads_the_saved_prefix_and_the_output_cache_matches(
        tmp_path: Path) -> None:
    """Worker A saves a request's blocks; a longer request sharing the prefix on worker B
    matches all full blocks short of its last token and loads them bit for bit."""
    _store, planner_a, mover_a, caches_a = setup(tmp_path, seed=1)
    ids = list(range(100, 114))  # 3 full blocks and 2 tokens
    req = FakeRequest("a", ids, num_computed_tokens=14)
    planner_a.track(req)
    mover_a.save(step_saves(planner_a, req, [3, 9, 4, 0]))
    assert mover_a.stats.saved_blocks == 3

    _, planner_b, mover_b, caches_b = setup(tmp_path, seed=2)
    longer = FakeRequest("b", [*ids, 7, 7, 7])
    assert planner_b.matched_tokens(longer, 0) == 12
    exact = FakeRequest("c", ids[:12])  # 3 full blocks: the last token must be computed
    assert planner_b.matched_tokens(exact, 0) == 8
    planner_b.allocated(longer, [10, 11, 12, 13, 14], 12)
    plan = planner_b.plan(["b"], lambda _: [10, 11, 12, 13, 14])
    assert [m.block_id for m in plan.loads["b"]] == [10, 11, 12]
    assert plan.saves == []  # loaded blocks are not saved again
    mover_b.run(plan)
    for name in caches_a:
        assert torch.equal(caches_b[name][[10, 11, 12]], caches_a[name][[3, 9, 4]])
    assert mover_b.failed_blocks() == set()


@pytest.mark.parametrize("params", [{"ftctl_load": False}, {"ftctl_load": False, "x": 1}])
def test_a_request_asked_not_to_load_loads_nothing_and_still_saves(
        tmp_path: Path, params: dict[str, Any]) -> None:
    """kv_transfer_params ftctl_load false: no match, nothing loaded, its blocks saved;
    the same request without it loads the stored prefix, and `finished` says how much."""
    _store, planner, mover, _ = setup(tmp_path)
    ids = list(range(13))
    first = FakeRequest("a", ids, num_computed_tokens=12)
    planner.track(first)
    mover.save(step_saves(planner, first, [0, 1, 2]))
    assert planner.finished("a") == 0
    bypass = FakeRequest("b", [*ids, 1], kv_transfer_params=params)
    planner.track(bypass)
    assert planner.matched_tokens(bypass, 0) == 0
    planner.allocated(bypass, [4, 5, 6, 7], 0)
    assert planner.plan(["b"], lambda _: [4, 5, 6, 7]).loads == {}
    bypass.num_computed_tokens = 14
    assert [m.block_id for m in step_saves(planner, bypass, [4, 5, 6, 7])] == [4, 5, 6]
    assert planner.finished("b") == 0
    for value in (True, None, 0, "false"):  # only the boolean false turns loading off
        load = FakeRequest(f"c{value}", [*ids, 1], kv_transfer_params={"ftctl_load": value})
        planner.track(load)
        assert planner.matched_tokens(load, 0) == 12
        planner.allocated(load, [8, 9, 10, 11], 12)
        assert planner.finished(load.request_id) == 12


def test_local_prefix_hits_are_not_counted_again(tmp_path: Path) -> None:
    """Tokens the engine has locally (num_computed_tokens) are not offered again."""
    _store, planner, mover, _ = setup(tmp_path)
    ids = list(range(13))
    req = FakeRequest("a", ids, num_computed_tokens=12)
    planner.track(req)
    mover.save(step_saves(planner, req, [0, 1, 2]))
    assert planner.matched_tokens(FakeRequest("b", ids), 4) == 8
    assert planner.matched_tokens(FakeRequest("c", ids), 12) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_block_ends_the_match_there(tmp_path: Path, damage: str) -> None:
    """A damaged or missing second block: only the first matches."""
    store, planner, mover, _ = setup(tmp_path)
    ids = list(range(13))
    req = FakeRequest("a", ids, num_computed_tokens=12)
    planner.track(req)
    mover.save(step_saves(planner, req, [0, 1, 2]))
    path = store.path_for(chain_keys(NS, ids, BS)[1])
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-3] ^= 0x40
        path.write_bytes(raw)
    elif damage == "truncate":
        path.write_bytes(raw[:-8])
    else:
        path.unlink()
    assert Planner(store, NS, BS).matched_tokens(FakeRequest("b", ids), 0) == 4


def test_a_block_damaged_after_the_match_fails_its_load_not_the_step(tmp_path: Path) -> None:
    """A block that passes the scheduler's check but is damaged before the worker reads
    it is reported as failed (with every block after it), its file removed; the blocks
    before it are loaded."""
    store, planner, mover, caches = setup(tmp_path, seed=3)
    ids = list(range(13))
    req = FakeRequest("a", ids, num_computed_tokens=12)
    planner.track(req)
    mover.save(step_saves(planner, req, [0, 1, 2]))
    keys = chain_keys(NS, ids, BS)
    _, planner_b, mover_b, caches_b = setup(tmp_path, seed=4)
    longer = FakeRequest("b", [*ids, 1])
    assert planner_b.matched_tokens(longer, 0) == 12
    planner_b.allocated(longer, [5, 6, 7, 8], 12)
    path = store.path_for(keys[1])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    mover_b.run(planner_b.plan(["b"], lambda _: [5, 6, 7, 8]))
    assert mover_b.failed_blocks() == {6, 7}
    assert mover_b.failed_blocks() == set()
    assert not path.exists()
    assert torch.equal(caches_b["layer.0"][5], caches["layer.0"][0])


def test_a_block_of_another_shape_is_a_miss_on_load(tmp_path: Path) -> None:
    """A block written by a cache of another geometry (layer count) fails the load."""
    store = BlockStore(tmp_path / "store", 1 << 30)
    writer = BlockMover(store)
    writer.register(cpu_cache(1, layers=2), NUM_BLOCKS)
    key = chain_keys(NS, list(range(4)), BS)[0]
    writer.save([BlockMove(key, 0)])
    reader = BlockMover(store)
    reader.register(cpu_cache(2, layers=3), NUM_BLOCKS)
    assert reader.load("r", [BlockMove(key, 3)]) == 0
    assert reader.failed_blocks() == {3}


def test_saves_skip_blocks_already_stored(tmp_path: Path) -> None:
    """A block another request (or worker) stored is not written again."""
    _store, _, mover, _ = setup(tmp_path)
    key = chain_keys(NS, list(range(4)), BS)[0]
    mover.save([BlockMove(key, 0)])
    mover.save([BlockMove(key, 1)])
    assert (mover.stats.saved_blocks, mover.stats.skipped_saves) == (1, 1)


def test_an_unwritable_store_loses_saves_not_the_step(tmp_path: Path) -> None:
    """A store that refuses writes is counted and logged; save returns."""
    store, _, mover, _ = setup(tmp_path)
    key = chain_keys(NS, list(range(4)), BS)[0]
    store.path_for(key).parent.write_bytes(b"in the way")
    assert mover.save([BlockMove(key, 0)]) == 0
    assert mover.stats.save_errors == 1


def test_flash_layout_blocks_on_dim_one_round_trip(tmp_path: Path) -> None:
    """Caches with blocks on dim 1 ([2, num_blocks, ...]) save and load exactly."""
    store = BlockStore(tmp_path / "store", 1 << 30)
    gen = torch.Generator().manual_seed(5)
    src = {"l0": torch.randn(2, NUM_BLOCKS, BS, HEADS, DIM, generator=gen)}
    dst = {"l0": torch.zeros(2, NUM_BLOCKS, BS, HEADS, DIM)}
    a, b = BlockMover(store), BlockMover(store)
    a.register(src, NUM_BLOCKS)
    b.register(dst, NUM_BLOCKS)
    assert a.block_dim == 1
    key = chain_keys(NS, list(range(4)), BS)[0]
    a.save([BlockMove(key, 2)])
    assert b.load("r", [BlockMove(key, 9)]) == 1
    assert torch.equal(dst["l0"][:, 9], src["l0"][:, 2])


@pytest.mark.gpu
def test_a_cuda_cache_round_trips_through_pinned_buffers(tmp_path: Path) -> None:
    """On a GPU, saves and loads go through pinned host buffers and the copier's side
    stream, exactly (the copier's stream pipeline itself is covered by kv's lazy fakes)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the copier's device routes are covered by "
                    "tests/unit/kv/test_kv_copy.py's lazy fake streams")
    store = BlockStore(tmp_path / "store", 1 << 30)
    src = {k: v.cuda() for k, v in cpu_cache(6).items()}
    dst = {k: v.cuda() for k, v in cpu_cache(7).items()}
    a, b = BlockMover(store), BlockMover(store)
    a.register(src, NUM_BLOCKS)
    b.register(dst, NUM_BLOCKS)
    assert a._host_blocks(1)[0].is_pinned()
    keys = chain_keys(NS, list(range(12)), BS)
    a.save([BlockMove(k, i) for k, i in zip(keys, [4, 1, 7], strict=True)])
    assert b.load("r", [BlockMove(k, i) for k, i in zip(keys, [0, 2, 3], strict=True)]) == 3
    for name in src:
        assert torch.equal(dst[name][[0, 2, 3]], src[name][[4, 1, 7]])


def test_a_cache_without_the_block_count_is_refused(tmp_path: Path) -> None:
    """Registering tensors with no dimension of the block count is InvalidInput."""
    mover = BlockMover(BlockStore(tmp_path, 1 << 20))
    with pytest.raises(InvalidInput):
        mover.register({"l": torch.zeros(3, 5)}, NUM_BLOCKS)


@pytest.mark.parametrize("extra", [None, {}, {"store": ""}, {"store": 3},
                                   {"store": "/x", "budget_bytes": 0},
                                   {"store": "/x", "budget_bytes": True},
                                   {"store": "/x", "budget_bytes": "1G"}])
def test_bad_extra_config_is_refused_by_name(extra: Any) -> None:
    """kv_connector_extra_config without a store or with a bad budget is InvalidInput."""
    with pytest.raises(InvalidInput, match=r"store|budget_bytes"):
        _adapter.settings_from(extra)


def test_the_package_imports_without_vllm() -> None:
    """Importing dynamo_ftctl.vllm_connector loads neither vLLM nor torch; asking for the
    class without vLLM names the extra to install."""
    import subprocess
    import sys

    code = ("import sys, dynamo_ftctl.vllm_connector as c\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
            "try:\n    c.FtctlConnector\nexcept Exception as exc:\n    print(exc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    # no vLLM in the dev venv: one line naming the extra, not a traceback
    assert "pip install 'dynamo-ftctl[vllm]'" in done.stdout
