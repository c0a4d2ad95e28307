"""The engine core: requests, continuous batching, KV export/import, sleep.

`Engine.step()` is one scheduler iteration: admit waiting requests while KV
blocks last (FIFO; a request waits instead of failing), make room for running
decodes (preempting the youngest running request when the pool is dry; it is
recomputed later), run ONE batched forward over every scheduled sequence's new
tokens (prefills and decodes together), sample, and return the token events.

Threading: `submit` and `abort` may be called from any thread (they only touch
locked inboxes); `step`, `export_kv`, `import_kv`, `sleep` and `wake` must be
called by one thread at a time (the async driver serializes them).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from dynamo_ftctl import structs
from dynamo_ftctl.engine.cache import BlockAllocator, blocks_for
from dynamo_ftctl.engine.config import EngineConfig
from dynamo_ftctl.engine.errors import BatchDeath
from dynamo_ftctl.engine.model import AttentionPlan, KVPool, PrefillSpan, TinyTransformer
from dynamo_ftctl.engine.sampling import SampledToken, SampleParams, sample_batch
from dynamo_ftctl.engine.tokenizer import load_tokenizer
from dynamo_ftctl.errors import InvalidInput

__all__ = ["Engine", "EngineRequest", "RequestParams", "RequestState", "TokenEvent"]

# An aborted request (client gone, stream dropped) keeps its KV blocks this long so
# that a migrating proxy can still export them; the pool reclaims them first when dry.
# They lapse on a timer (`expire_retained`, from the driver while idle), not only when
# the engine steps, and they are not load: `kv_usage` leaves them out.
RETAIN_S = 60.0
# The `nondeterministic` config's greedy rows pick among this many likeliest tokens.
JITTER_TOP_K = 4

_log = logging.getLogger("ftctl.sim")


class RequestState(Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestParams:
    """Sampling and stopping parameters of one request."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    num_top: int = 0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0  # no EOS or stop id ends the request before this many tokens

    def to_json(self) -> dict[str, Any]:
        """The sampling state carried in a KV export."""
        return {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "seed": self.seed, "ignore_eos": self.ignore_eos,
            "num_top": self.num_top, "stop_token_ids": list(self.stop_token_ids),
            "min_tokens": self.min_tokens,
        }


@dataclass(eq=False)
class EngineRequest:
    """One sequence: prompt ids, generated ids, its blocks and its state."""

    request_id: str
    prompt_ids: list[int]
    params: RequestParams
    seed: int = 0  # the effective sampling seed (params.seed or a random one)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens whose K/V are in the cache
    state: RequestState = RequestState.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    retained_until: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_output(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - len(self.prompt_ids)


@dataclass(frozen=True)
class TokenEvent:
    """One step's news for one request: a token, a finish, or an error."""

    request_id: str
    token: SampledToken | None
    finish_reason: str | None = None
    error: str | None = None


class Engine:
    """The model, the paged cache and the continuous-batching scheduler."""

    def __init__(
        self, config: EngineConfig, seed: int = 0, device: str = "cpu",
    ) -> None:
        self.tokenizer = load_tokenizer(config.tokenizer)
        vocab = self.tokenizer.vocab_size
        if config.vocab_size is None:
            # The model's vocabulary follows its tokenizer unless a config pins it.
            config = structs.replace(config, vocab_size=vocab)
        elif config.vocab_size < vocab:
            msg = (f"engine config: vocab_size {config.vocab_size} is smaller than the "
                   f"{config.tokenizer} tokenizer's {vocab} ids")
            raise InvalidInput(msg)
        self.config = config
        self.seed = seed
        self.device = torch.device(device)
        self.model = TinyTransformer(config, seed, self.device, self.tokenizer.printable_ids())
        self.pool: KVPool | None = KVPool(config, self.device)
        self.allocator = BlockAllocator(config.num_blocks)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.retained: dict[str, EngineRequest] = {}
        self.retain_s = RETAIN_S
        self._retained_blocks = 0  # blocks held by `retained`
        self.corrupt_logits = False
        # The poison fault: a request with this seed ends its whole batch (`BatchDeath`).
        self.poison_seed: int | None = None
        self.asleep = 0  # sleep level, 0 = awake
        self._inbox: deque[EngineRequest] = deque()
        self._aborts: deque[tuple[str, bool]] = deque()
        self._inbox_lock = threading.Lock()
        self._block_arange = torch.arange(config.block_size, device=self.device)

    # -- requests -----------------------------------------------------------

    def new_request(
        self, prompt_ids: list[int], params: RequestParams, request_id: str | None = None,
    ) -> EngineRequest:
        """A validated request (not yet submitted); `InvalidInput` when it cannot fit."""
        c = self.config
        if not prompt_ids:
            msg = "the prompt is empty"
            raise InvalidInput(msg)
        vocab = self.model.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            msg = f"token id {bad[0]} is out of range [0, {vocab})"
            raise InvalidInput(msg)
        total = len(prompt_ids) + params.max_tokens
        if total > c.max_model_len:
            msg = (
                f"This model's maximum context length is {c.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length."
            )
            raise InvalidInput(msg)
        if blocks_for(total, c.block_size) > c.num_blocks:
            msg = (f"request needs {blocks_for(total, c.block_size)} KV blocks; the whole "
                   f"cache has {c.num_blocks}")
            raise InvalidInput(msg)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        return EngineRequest(rid, list(prompt_ids), params, seed=seed)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request (thread-safe); it joins the batch at the next step."""
        with self._inbox_lock:
            self._inbox.append(request)

    def abort(self, request_id: str, *, retain: bool = False) -> None:
        """Stop a request at the next step (thread-safe); `retain` keeps its KV a while."""
        with self._inbox_lock:
            self._aborts.append((request_id, retain))

    def has_work(self) -> bool:
        """True when a step would do something."""
        return bool(self.running or self.waiting or self._inbox or self._aborts)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for KV blocks or a batch slot."""
        return len(self.waiting) + len(self._inbox)

    @property
    def kv_usage(self) -> float:
        """vLLM's `kv_cache_usage_perc` (0..1): the share of the pool live requests hold.

        Retained blocks are left out: only an export may still read them, and the
        pool takes them back as soon as a live request needs room (`_reserve`), as
        vLLM counts its evictable prefix-cache blocks free. Counted, they would make an
        idle engine look full to the proxy, which would then send it nothing to step
        on, so they would never lapse either.
        """
        return (self.allocator.used - self._retained_blocks) / self.allocator.num_blocks

    def next_expiry(self) -> float | None:
        """When the first retained request lapses (`time.monotonic()`), None without one."""
        return min((r.retained_until for r in self.retained.values()), default=None)

    def expire_retained(self, now: float | None = None) -> int:
        """Free the blocks of retained requests whose time is up; how many lapsed."""
        now = time.monotonic() if now is None else now
        lapsed = [rid for rid, r in self.retained.items() if r.retained_until < now]
        for request_id in lapsed:
            self._drop_retained(request_id)
        return len(lapsed)

    # -- the step -------------------------------------------------------------

    def _drain_inbox(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        with self._inbox_lock:
            incoming = list(self._inbox)
            self._inbox.clear()
            aborts = list(self._aborts)
            self._aborts.clear()
        for request in incoming:
            if request.request_id in self.requests:
                events.append(TokenEvent(request.request_id, None, "abort",
                                         "a request with this id is already running"))
                continue
            self.requests[request.request_id] = request
            self.waiting.append(request)
        for request_id, retain in aborts:
            live = self.requests.get(request_id)
            if live is not None:
                self._finish(live, "abort", retain=retain)
                events.append(TokenEvent(request_id, None, "abort", "request aborted"))
        self.expire_retained()
        return events

    def _finish(self, request: EngineRequest, reason: str, *, retain: bool = False) -> None:
        request.finish_reason = reason
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
        elif request.state is RequestState.WAITING:
            self.waiting.remove(request)
        request.state = RequestState.FINISHED
        self.requests.pop(request.request_id, None)
        if retain and request.block_table:
            request.retained_until = time.monotonic() + self.retain_s
            self._drop_retained(request.request_id)
            self.retained[request.request_id] = request
            self._retained_blocks += len(request.block_table)
        else:
            self.allocator.release(request.block_table)
            request.block_table = []

    def _drop_retained(self, request_id: str) -> None:
        old = self.retained.pop(request_id, None)
        if old is not None:
            self._retained_blocks -= len(old.block_table)
            self.allocator.release(old.block_table)
            old.block_table = []

    def _reserve(self, count: int) -> bool:
        """Make `count` blocks free, dropping retained exports first."""
        while self.allocator.free < count and self.retained:
            self._drop_retained(next(iter(self.retained)))
        return self.allocator.free >= count

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self.allocator.release(request.block_table)
        request.block_table = []
        request.num_cached = 0
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)

    def _grow(self, request: EngineRequest) -> bool:
        """Give `request` blocks for all its tokens; False when the pool is short."""
        need = blocks_for(len(request.token_ids), self.config.block_size) - len(
            request.block_table)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        request.block_table.extend(self.allocator.allocate(need))
        return True

    def _schedule(self) -> list[EngineRequest]:
        # Running decodes first, oldest first; the youngest is preempted when dry.
        scheduled: list[EngineRequest] = []
        for request in list(self.running):
            if request.state is not RequestState.RUNNING:
                continue  # preempted below by an older request
            while not self._grow(request):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request.state is RequestState.RUNNING:
                scheduled.append(request)
        budget = self.config.max_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            new_tokens = len(request.token_ids) - request.num_cached
            if scheduled and new_tokens > budget:
                break
            if not self._grow(request):
                break  # FIFO: wait for blocks to come back
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            self.running.append(request)
            scheduled.append(request)
            budget -= new_tokens
        return scheduled

    def step(self) -> list[TokenEvent]:
        """One scheduler iteration; returns the token/finish events it produced."""
        events = self._drain_inbox()
        if self.asleep or self.pool is None:
            return events
        scheduled = self._schedule()
        if not scheduled:
            return events
        poisoned = self.poison_seed
        if poisoned is not None and any(r.seed == poisoned for r in scheduled):
            msg = f"engine core died on a request with seed {poisoned} (poison fault)"
            raise BatchDeath(msg)
        try:
            sampled = self._compute(scheduled)
        except Exception:  # one request's doing, or the engine's: find out which
            _log.exception("a batched step of %d requests failed; stepping each alone",
                           len(scheduled))
            scheduled, sampled = self._compute_each(scheduled, events)
        max_len = self.config.max_model_len
        for request, token in zip(scheduled, sampled, strict=True):
            request.num_cached = len(request.token_ids)
            request.token_ids.append(token.token_id)
            reason = None
            wanted = request.params
            if not wanted.ignore_eos and request.num_output >= wanted.min_tokens and (
                token.token_id == self.tokenizer.eos_id
                or token.token_id in wanted.stop_token_ids
            ):
                reason = "stop"
            elif request.num_output >= request.params.max_tokens or len(
                    request.token_ids) >= max_len:
                reason = "length"
            if reason is not None:
                self._finish(request, reason)
            events.append(TokenEvent(request.request_id, token, reason))
        return events

    def _compute(self, scheduled: list[EngineRequest]) -> list[SampledToken]:
        """The next token of each scheduled request: one batched forward, then sampling."""
        with torch.inference_mode():
            logits = self._forward(scheduled)
            if self.corrupt_logits:
                # Silent data corruption: plausible-looking but wrong tokens and logprobs.
                logits = logits.flip(-1) * 0.7
            params = [
                SampleParams(r.params.temperature, r.params.top_p, r.params.top_k, r.seed,
                             len(r.token_ids), r.params.num_top)
                for r in scheduled
            ]
            if self.config.nondeterministic:
                logits, params = self._jitter(scheduled, logits, params)
            return sample_batch(logits, params)

    def _jitter(self, scheduled: list[EngineRequest], logits: torch.Tensor,
                params: list[SampleParams]) -> tuple[torch.Tensor, list[SampleParams]]:
        """The `nondeterministic` config: each greedy row picks at random among its
        `JITTER_TOP_K` likeliest tokens (a fresh random draw, whatever the seed), and a
        stop token only where the greedy pick is one, so answers vary but their length
        and finish reason do not (what a shape canary set is recorded for)."""
        stops = {self.tokenizer.eos_id}
        greedy = logits.argmax(dim=-1).tolist()
        logits = logits.clone()
        jittered = list(params)
        for row, (request, sample) in enumerate(zip(scheduled, params, strict=True)):
            if sample.temperature > 0:
                continue
            row_stops = stops | set(request.params.stop_token_ids)
            if greedy[row] in row_stops:
                continue
            logits[row, list(row_stops)] = -torch.inf
            jittered[row] = SampleParams(1.0, 1.0, JITTER_TOP_K, random.getrandbits(63),
                                         sample.position, sample.num_top)
        return logits, jittered

    def _compute_each(self, scheduled: list[EngineRequest], events: list[TokenEvent],
                      ) -> tuple[list[EngineRequest], list[SampledToken]]:
        """After a failed batched step: each request's token computed alone. One that fails
        alone is finished with an error event; the others go on as if batched (a
        request's tokens do not depend on its batch: the forward is per row, sampling
        keyed by seed and position, and the KV it writes is the same)."""
        kept: list[EngineRequest] = []
        sampled: list[SampledToken] = []
        for request in scheduled:
            try:
                token = self._compute([request])[0]
            except Exception as exc:
                _log.warning("request %s fails the engine step alone: %s",
                             request.request_id, exc)
                self._finish(request, "abort")
                events.append(TokenEvent(request.request_id, None, "abort",
                                         f"the engine step failed on this request: {exc}"))
                continue
            kept.append(request)
            sampled.append(token)
        return kept, sampled

    def _forward(self, scheduled: list[EngineRequest]) -> torch.Tensor:
        assert self.pool is not None
        bs = self.config.block_size
        dev = self.device
        tokens: list[int] = []
        positions: list[int] = []
        write_slots: list[torch.Tensor | int] = []
        decode_rows: list[int] = []
        decode_requests: list[EngineRequest] = []
        prefills: list[PrefillSpan] = []
        logit_rows: list[int] = []
        for request in scheduled:
            start, end = request.num_cached, len(request.token_ids)
            row = len(tokens)
            tokens.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            if end - start == 1:
                block, offset = divmod(start, bs)
                write_slots.append(request.block_table[block] * bs + offset)
                decode_rows.append(row)
                decode_requests.append(request)
            else:
                table = torch.tensor(request.block_table, dtype=torch.long, device=dev)
                context = (table[:, None] * bs + self._block_arange).view(-1)[:end]
                write_slots.append(context[start:end])
                prefills.append(PrefillSpan(row, row + end - start, context, start))
            logit_rows.append(len(tokens) - 1)
        slots = torch.cat([
            s if isinstance(s, torch.Tensor) else torch.tensor([s], dtype=torch.long, device=dev)
            for s in write_slots
        ]) if any(isinstance(s, torch.Tensor) for s in write_slots) else torch.tensor(
            write_slots, dtype=torch.long, device=dev)
        plan = AttentionPlan(None, None, None, tuple(prefills))
        if decode_requests:
            lengths = [r.num_cached + 1 for r in decode_requests]
            width = max(len(r.block_table) for r in decode_requests)
            tables = torch.tensor(
                [r.block_table + [0] * (width - len(r.block_table)) for r in decode_requests],
                dtype=torch.long, device=dev,
            )
            longest = max(lengths)
            dec_slots = (tables[:, :, None] * bs + self._block_arange).view(
                len(decode_requests), -1)[:, :longest]
            mask = torch.arange(longest, device=dev)[None, :] < torch.tensor(
                lengths, device=dev)[:, None]
            plan = AttentionPlan(
                torch.tensor(decode_rows, dtype=torch.long, device=dev), dec_slots, mask,
                tuple(prefills),
            )
        return self.model.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev), slots, plan, self.pool,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )

    # -- KV export / import ---------------------------------------------------

    def _find(self, request_id: str) -> EngineRequest | None:
        return self.requests.get(request_id) or self.retained.get(request_id)

    def export_kv(self, request_id: str) -> memoryview:
        """The request's token ids, sampling state and KV blocks in the wire format.

        The blocks are gathered by the block copier (`kv.payload`) straight into
        the export buffer. `InvalidInput` when no live or retained request has this id.
        """
        from dynamo_ftctl.kv.payload import gather_payload
        from dynamo_ftctl.kv.wire import KvHeader, KvLayout

        request = self._find(request_id)
        if request is None or self.pool is None:
            msg = f"no running or retained request {request_id!r}"
            raise InvalidInput(msg)
        c = self.config
        layout = KvLayout(c.n_layers, c.n_kv_heads, c.head_dim, c.block_size, c.dtype)
        header = KvHeader(
            layout=layout, model=c.name, request_id=request_id,
            token_ids=tuple(request.token_ids), prompt_len=len(request.prompt_ids),
            num_tokens=request.num_cached,
            sampling={**request.params.to_json(), "seed": request.seed},
        )
        return gather_payload(header, self._kv_tensors(), request.block_table[: header.num_blocks])

    def _kv_tensors(self) -> list[torch.Tensor]:
        """The pool as the wire orders a block: layer 0 K, layer 0 V, layer 1 K, ...,
        each `[num_blocks, block_size, kv heads, head dim]` sharing the pool's storage."""
        assert self.pool is not None
        k, v = self.pool.block_view("k"), self.pool.block_view("v")
        return [t[layer] for layer in range(self.config.n_layers) for t in (k, v)]

    def import_kv(
        self, payload: bytes | memoryview, request_id: str | None = None,
    ) -> EngineRequest:
        """A request resumed from an export, its blocks copied into this cache; `submit` it.

        `decode_kv` verifies the header and every block's checksum, then the block
        copier scatters the blocks into the request's new block table (`kv.payload`).
        `InvalidInput` when the export is damaged or does not fit this engine.
        """
        from dynamo_ftctl.kv.payload import scatter_payload
        from dynamo_ftctl.kv.wire import decode_kv

        decoded = decode_kv(payload)
        header = decoded.header
        c = self.config
        lay = header.layout
        mine = (c.n_layers, c.n_kv_heads, c.head_dim, c.block_size, c.dtype)
        theirs = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype)
        if mine != theirs:
            msg = (f"KV import: layout {theirs} (layers, kv heads, head dim, block size, dtype) "
                   f"does not match this engine's {mine}")
            raise InvalidInput(msg)
        s = header.sampling
        try:
            params = RequestParams(
                max_tokens=int(s["max_tokens"]), temperature=float(s.get("temperature", 0.0)),
                top_p=float(s.get("top_p", 1.0)), top_k=int(s.get("top_k", 0)),
                seed=int(s["seed"]), ignore_eos=bool(s.get("ignore_eos", False)),
                num_top=int(s.get("num_top", 0)),
                stop_token_ids=tuple(int(t) for t in s.get("stop_token_ids", ())),
                min_tokens=int(s.get("min_tokens", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            msg = f"KV import: bad sampling state: {exc}"
            raise InvalidInput(msg) from None
        ids = list(header.token_ids)
        prompt = ids[: header.prompt_len]
        request = self.new_request(prompt or ids[:1], params, request_id or header.request_id)
        request.seed = params.seed or 0
        request.token_ids = ids
        remaining = params.max_tokens - request.num_output
        if remaining <= 0 or header.num_tokens >= len(ids):
            msg = "KV import: nothing left to generate for this request"
            raise InvalidInput(msg)
        if not self._reserve(blocks_for(len(ids), c.block_size)) or self.pool is None:
            msg = "KV import: not enough free KV blocks on this engine"
            raise InvalidInput(msg)
        request.block_table = self.allocator.allocate(blocks_for(len(ids), c.block_size))
        scatter_payload(decoded, self._kv_tensors(), request.block_table[: header.num_blocks])
        request.num_cached = header.num_tokens
        return request

    # -- sleep / wake ------------------------------------------------------------

    def sleep(self, level: int = 1) -> list[str]:
        """Drop the KV cache (aborting every request) and offload (1) or drop (2) weights.

        Returns the ids of the requests that were aborted.
        """
        self._drain_inbox()
        aborted = [r.request_id for r in (*self.running, *self.waiting)]
        for request_id in aborted:
            self._finish(self.requests[request_id], "abort")
        for request_id in list(self.retained):
            self._drop_retained(request_id)
        self.pool = None
        if level >= 2:
            self.model.drop()
        elif self.device.type != "cpu":
            self.model.to(torch.device("cpu"))
        self.asleep = level
        return aborted

    def wake(self) -> None:
        """Bring weights back (regenerated from the seed after level 2) and a fresh cache."""
        if not self.asleep:
            return
        if self.asleep >= 2:
            self.model.rebuild()
        else:
            self.model.to(self.device)
        self.pool = KVPool(self.config, self.device)
        self.allocator = BlockAllocator(self.config.num_blocks)
        self.asleep = 0
