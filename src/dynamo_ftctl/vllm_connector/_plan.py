"""The scheduler's half of the connector: which blocks a request can load, which to save.

`Planner` sees requests as duck-typed objects (`request_id`, `all_token_ids`,
`num_computed_tokens`: vLLM's `Request`) and returns plain, picklable plans
(`StepPlan`) that the worker half carries out; it never touches a tensor.

- **Matching.** A request's full blocks, short of its last token (the engine
  must compute at least one token), are keyed by `blockstore.chain_keys`; the
  leading run of keys whose files are whole in the store (every shard's,
  checksums verified: `BlockStore.verify`, memoized by inode and mtime) is what
  it may load. A damaged file is a miss, never an error, and is removed so that
  the next worker to compute the block saves it again.
- **Saving.** A block is saved in the step after it filled: when the tokens the
  engine had computed before a step (`num_computed_tokens`) and whose ids are
  known (`all_token_ids`; under async scheduling the last ones lag) cover it.
  Its KV is then in the paged cache, and the request still holds the block
  while the step runs. Prompt and generated tokens alike; a chunked prefill is
  saved chunk by chunk.
- **Asked not to load.** A request whose `kv_transfer_params` hold `ftctl_load: false`
  (`blockstore.LOAD_PARAM`) loads nothing (its blocks are saved all the same).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_ftctl.kv.blockstore import LOAD_PARAM, BlockStore, chain_keys

__all__ = ["BlockMove", "Planner", "StepPlan"]


@dataclass(frozen=True)
class BlockMove:
    """One block between the store (`key`) and the paged cache (`block_id`)."""

    key: bytes
    block_id: int


@dataclass
class StepPlan:
    """One engine step's work for the workers: loads per request, in block order, and
    saves. Picklable (it crosses to worker processes)."""

    loads: dict[str, list[BlockMove]] = field(default_factory=dict)
    saves: list[BlockMove] = field(default_factory=list)


@dataclass
class _Tracked:
    """What the planner keeps of one live request."""

    request: Any
    keys: list[bytes] = field(default_factory=list)
    saved: int = 0  # blocks from 0 known to be in the store (saved or loaded)
    load_from: int = 0  # the match's first block (local prefix-cache hits before it)
    load_blocks: int = 0  # the match's length in blocks
    loaded: int = 0  # tokens planned to load from the store


class Planner:
    """Plans loads and saves for one engine's scheduler.

    `shards` are the file suffixes of one block's shards (one per TP x PP rank): a
    block matches only when every shard's file is whole.
    """

    def __init__(self, store: BlockStore, namespace: bytes, block_size: int,
                 shards: Sequence[str] = ("",)) -> None:
        self.store = store
        self.namespace = namespace
        self.block_size = block_size
        self.shards = tuple(shards)
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, list[BlockMove]] = {}

    def _tracked(self, request: Any) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = _Tracked(request)
            self._requests[request.request_id] = tracked
        return tracked

    def _keys(self, tracked: _Tracked, blocks: int) -> list[bytes]:
        """The request's first `blocks` keys, extending its chain as its ids grow."""
        have = len(tracked.keys)
        if blocks > have:
            ids = list(tracked.request.all_token_ids[:blocks * self.block_size])
            tracked.keys.extend(chain_keys(
                self.namespace, ids, self.block_size, start=have,
                previous=tracked.keys[-1] if have else None))
        return tracked.keys[:blocks]

    def _whole(self, key: bytes) -> bool:
        """Every shard of `key` is whole; a damaged one is removed (a worker saves the
        block again the next time it computes it)."""
        for shard in self.shards:
            if not self.store.verify(key, suffix=shard):
                if self.store.has(key, shard):
                    self.store.discard(key, shard)
                return False
        return True

    def track(self, request: Any) -> None:
        """Start tracking a new request (vLLM: `on_new_request`)."""
        self._tracked(request)

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` (block-aligned local hits) the store can
        supply: whole blocks only, never the request's last token."""
        tracked = self._tracked(request)
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get(LOAD_PARAM) is False:
            tracked.load_blocks = 0
            return 0
        usable = (len(request.all_token_ids) - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        keys = self._keys(tracked, usable)
        found = 0
        for key in keys[start:]:
            if not self._whole(key):
                break
            found += 1
        tracked.load_from, tracked.load_blocks = start, found
        return max(0, (start + found) * self.block_size - num_computed_tokens)

    def allocated(self, request: Any, block_ids: Sequence[int], external_tokens: int) -> None:
        """The engine gave the request `block_ids` and will take `external_tokens` from
        the store (vLLM: `update_state_after_alloc`): plan the load."""
        tracked = self._tracked(request)
        if external_tokens <= 0:
            return
        start = tracked.load_from
        count = min(external_tokens // self.block_size, tracked.load_blocks)
        keys = self._keys(tracked, start + count)
        self._pending_loads[request.request_id] = [
            BlockMove(keys[i], block_ids[i]) for i in range(start, start + count)]
        tracked.saved = max(tracked.saved, start + count)
        tracked.loaded = count * self.block_size

    def plan(self, scheduled: Iterable[str],
             block_ids_of: Callable[[str], Sequence[int]]) -> StepPlan:
        """This step's plan: the loads planned since the last step, and the saves of the
        scheduled requests' blocks that filled before it. Clears the pending loads."""
        step = StepPlan(loads=self._pending_loads)
        self._pending_loads = {}
        for request_id in scheduled:
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            known = min(request.num_computed_tokens, len(request.all_token_ids))
            full = known // self.block_size
            if full <= tracked.saved:
                continue
            keys = self._keys(tracked, full)
            block_ids = block_ids_of(request_id)
            step.saves.extend(BlockMove(keys[i], block_ids[i])
                              for i in range(tracked.saved, min(full, len(block_ids))))
            tracked.saved = full
        return step

    def finished(self, request_id: str) -> int:
        """Forget a finished request (its unsaved blocks are not saved); the tokens it
        loaded from the store."""
        tracked = self._requests.pop(request_id, None)
        self._pending_loads.pop(request_id, None)
        return tracked.loaded if tracked is not None else 0
