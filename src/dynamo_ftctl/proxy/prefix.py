"""The prefix index: which workers served which prompt prefixes (cache-aware routing).

A key is a prompt cut in blocks: token ids 16 a block (vLLM's default KV block), or
text 64 characters a block (about as many tokens). Each block's hash takes the hash
of the blocks before it (a chain, as vLLM's prefix cache names its blocks), so one
block hash names the whole prefix up to that block's end, and a partial last block
is not indexed (an engine caches full blocks only).

`PrefixIndex` maps a block hash to the workers that served a prompt holding it. It
keeps at most `max_entries` (block, worker) pairs: past that the least recently
used blocks go, the deepest first (a key's blocks are touched leaf to root), as an
engine's cache and sglang-router's tree evict leaves. Its memory is bounded
whatever the requests; a 64-bit hash that collides only misroutes a request.

Text keys of chats render the messages in one canonical form (role, separator,
content, terminator; non-text parts as sorted JSON), so the messages of one turn
render to a prefix of the next turn's, whose messages repeat them and add the
assistant's reply and a new user message. A key always ends in the opening of an
assistant message and the reply so far: the key of a finished turn is a prefix of
the next turn's.

Pure code, no I/O.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo_ftctl.proxy.ledger import StreamLedger

__all__ = ["BLOCK_CHARS", "BLOCK_TOKENS", "PrefixIndex", "PrefixKey", "prefix_key",
           "render_messages", "text_key", "token_key"]

BLOCK_TOKENS = 16
BLOCK_CHARS = 64
# Separators no chat text holds in practice (ASCII unit and record separators).
_ROLE_END = "\x1f"
_MESSAGE_END = "\x1e"


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """A prompt as chained block hashes, and its whole length in its own unit (tokens or
    characters, the partial last block included)."""

    blocks: tuple[int, ...]
    length: int
    unit: int  # tokens or characters a block


def _chain(root: int, pieces: Iterable[Any]) -> tuple[int, ...]:
    out: list[int] = []
    prev = root
    for piece in pieces:
        prev = hash((prev, piece))
        out.append(prev)
    return tuple(out)


def token_key(model: str | None, ids: Sequence[int]) -> PrefixKey:
    """The key of a prompt of token ids."""
    full = len(ids) - len(ids) % BLOCK_TOKENS
    pieces = (tuple(ids[i:i + BLOCK_TOKENS]) for i in range(0, full, BLOCK_TOKENS))
    return PrefixKey(_chain(hash(("ids", model)), pieces), len(ids), BLOCK_TOKENS)


def text_key(model: str | None, text: str) -> PrefixKey:
    """The key of a prompt of text."""
    full = len(text) - len(text) % BLOCK_CHARS
    pieces = (text[i:i + BLOCK_CHARS] for i in range(0, full, BLOCK_CHARS))
    return PrefixKey(_chain(hash(("text", model)), pieces), len(text), BLOCK_CHARS)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    return "" if content is None else json.dumps(content, sort_keys=True, separators=(",", ":"))


def render_messages(messages: Any) -> str | None:
    """Chat messages as one canonical text (None: not a list of messages)."""
    if not isinstance(messages, list):
        return None
    out: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        out.append(f"{message.get('role', '')}{_ROLE_END}"
                   f"{_content(message.get('content'))}{_MESSAGE_END}")
    return "".join(out)


def prefix_key(ledger: StreamLedger, model: str | None) -> PrefixKey | None:
    """The key of a request's prompt and what it generated so far (None: no prompt to key).

    Token ids where the client sent them (a completion's prompt of ids) and the
    workers returned the generated ones; text otherwise (the worker's ids are
    known only after a worker was chosen, and a conversation's turns must key the
    same way each turn).
    """
    body = ledger.body
    prompt = body.get("prompt")
    if ledger.endpoint == "completions":
        if isinstance(prompt, list) and ledger.prompt_ids is not None \
                and len(ledger.generated_ids) == ledger.generated_count:
            return token_key(model, ledger.prompt_ids + ledger.generated_ids)
        if isinstance(prompt, str):
            return text_key(model, prompt + ledger.output_text)
        return None
    rendered = render_messages(body.get("messages"))
    if rendered is None:
        return None
    return text_key(model, f"{rendered}assistant{_ROLE_END}{ledger.output_text}")


class PrefixIndex:
    """Block hash -> the workers that served it, least recently used first; bounded."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            msg = "max_entries must be at least 1"
            raise ValueError(msg)
        self.max_entries = max_entries
        self._blocks: OrderedDict[int, list[str]] = OrderedDict()
        self._pairs = 0
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        """(block, worker) pairs held."""
        return self._pairs

    @property
    def blocks(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def held_by(self, worker: str) -> int:
        """Blocks `worker` holds."""
        return self._held.get(worker, 0)

    def match(self, key: PrefixKey) -> dict[str, int]:
        """For each worker, how many of `key`'s first blocks it holds, all of them in a row
        from the first (workers holding none are left out)."""
        depth: dict[str, int] = {}
        blocks = self._blocks
        for i, h in enumerate(key.blocks):
            workers = blocks.get(h)
            if not workers:
                break
            found = False
            for worker in workers:
                if depth.get(worker, 0) == i:
                    depth[worker] = i + 1
                    found = True
            if not found:
                break
        return depth

    def insert(self, key: PrefixKey, worker: str) -> None:
        """`worker` served `key`: it holds each of its blocks; evict past the bound."""
        blocks = self._blocks
        # Leaf to root: the root ends most recent, so eviction takes leaves first.
        for h in reversed(key.blocks):
            workers = blocks.get(h)
            if workers is None:
                blocks[h] = [worker]
            else:
                blocks.move_to_end(h)
                if worker in workers:
                    continue
                workers.append(worker)
            self._pairs += 1
            self._held[worker] = self._held.get(worker, 0) + 1
        while self._pairs > self.max_entries:
            _, gone = blocks.popitem(last=False)
            self._drop(gone)

    def forget(self, worker: str) -> None:
        """`worker` holds nothing now (it restarted, or left the fleet)."""
        if not self._held.pop(worker, 0):
            return
        empty = []
        for h, workers in self._blocks.items():
            if worker in workers:
                workers.remove(worker)
                self._pairs -= 1
                if not workers:
                    empty.append(h)
        for h in empty:
            del self._blocks[h]

    def _drop(self, workers: list[str]) -> None:
        self._pairs -= len(workers)
        for worker in workers:
            left = self._held[worker] - 1
            if left:
                self._held[worker] = left
            else:
                del self._held[worker]
