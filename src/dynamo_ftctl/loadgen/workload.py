"""Request bodies: synthetic prompts of exact byte lengths, multi-turn conversations,
prompt files and traces.

`RequestFactory.build(i)` returns the i-th request (target URL, body bytes,
headers) so the send loop does no JSON work of its own. Prompt and trace
files are JSONL; a bad line is refused as `file:line: key: message` (exit 2).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from dynamo_ftctl.documents import Located, parse_json, read_document
from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.loadgen.config import Length, Workload
from dynamo_ftctl.structs import StrictStruct, convert_struct, doc

__all__ = ["PRIORITY_HEADER", "PromptItem", "RequestFactory", "RequestSpec", "load_prompts"]

# The proxy reads a request's priority from this header (admission control).
PRIORITY_HEADER = "x-ftctl-priority"
_ALPHABET = string.ascii_lowercase + "     "  # about one space per six letters
_MAX_FILE_BYTES = 256 * 1024 * 1024


class PromptItem(StrictStruct, frozen=True, kw_only=True):
    """One line of a prompt file or trace."""

    prompt: Annotated[str | None, doc("Completion prompt text.")] = None
    messages: Annotated[tuple[dict[str, Any], ...] | None, doc("Chat messages.")] = None
    max_tokens: Annotated[int, doc("Output tokens for this request.", ge=1)] | None = None
    timestamp: Annotated[float, doc("Send time in a trace (seconds).", ge=0)] | None = None


def load_prompts(path: Path, *, trace: bool) -> tuple[PromptItem, ...]:
    """Read a JSONL prompt file (or a trace, whose lines need `timestamp`), sorted by time."""
    text = read_document(path, limit=_MAX_FILE_BYTES, what="JSON lines")
    items: list[PromptItem] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        raw = parse_json(line, path, line=number)
        # Every key of a line is on that line: the line map holds the root alone.
        item = convert_struct(raw, PromptItem, Located(raw, {(): number}), path)
        if (item.prompt is None) == (item.messages is None):
            raise InventoryError("give exactly one of prompt or messages", path=path,
                                 line=number, key="prompt")
        if trace and item.timestamp is None:
            raise InventoryError("a trace line needs a timestamp", path=path, line=number,
                                 key="timestamp")
        items.append(item)
    if not items:
        raise InventoryError("no prompts in file", path=path)
    if trace:
        items.sort(key=lambda it: it.timestamp or 0.0)
    return tuple(items)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request ready to send."""

    index: int
    target: str
    url: str
    body: bytes
    headers: dict[str, str]
    max_tokens: int


# msgspec's encoder: compact like json.dumps(separators=(",", ":")), a few times faster;
# non-ASCII text goes as UTF-8 rather than \u escapes (the same JSON to any parser).
_encode = msgspec.json.Encoder().encode
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finalizer: the next of a request's pseudo-random draws.

    A request's draws are hashed from (seed, index) instead of seeding a
    `random.Random` per request: seeding a Mersenne twister cost a third of building
    a request, and building one cost about half a closed-loop request's CPU
    (benchmarks/load.py). Deterministic for a seed.
    """
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _draw(draw: int, length: Length) -> int:
    return length.low if length.low == length.high else length.low + draw % (
        length.high - length.low + 1)


def synthetic_prompt(rng: random.Random, tokens: int) -> str:
    """A prompt of exactly `tokens` ASCII bytes (= tokens for a byte tokenizer, about as many
    for a BPE: random characters rarely form a trained merge)."""
    return "".join(rng.choices(_ALPHABET, k=tokens))


# Synthetic prompts are windows of one random text drawn once per run: a slice
# instead of a random draw per byte (which cost more CPU per request than sending it).
_POOL_MIN = 1 << 12


class RequestFactory:
    """Builds request i of a run: round-robin over targets, deterministic for a seed."""

    def __init__(self, workload: Workload, targets: tuple[str, ...], *, seed: int = 0,
                 model: str | None = None,
                 items: tuple[PromptItem, ...] | None = None) -> None:
        self.workload = workload
        self.targets = targets
        self.seed = seed
        self.model = model if model is not None else workload.model
        self.items = items
        path = "/v1/chat/completions" if workload.api == "chat" else "/v1/completions"
        self._urls = tuple(t.rstrip("/") + path for t in targets)
        self._headers = {"content-type": "application/json"}
        if workload.priority is not None:
            self._headers[PRIORITY_HEADER] = workload.priority
        self._pool = ""
        if items is None:
            size = max(_POOL_MIN, 2 * workload.prompt_tokens.high, 2 * workload.max_tokens.high)
            self._pool = synthetic_prompt(random.Random(seed), size)

    def _window(self, draw: int, length: int) -> str:
        """`length` characters of the pool from a place `draw` picks."""
        start = _mix(draw) % (len(self._pool) - length + 1)
        return self._pool[start:start + length]

    def _conversation(self, index: int) -> tuple[list[tuple[str, str]], str, int]:
        """Request `index` of a multi-turn workload: the (user, reply) turns before it, its
        user message, and its max_tokens (the reply length its turn stands for)."""
        wl = self.workload
        count = wl.conversations or 1
        generation, within = divmod(index, count * wl.turns)
        turn, slot = divmod(within, count)
        conversation = _mix(self.seed * 1_000_003 + 0x5EED) + generation * count + slot
        done: list[tuple[str, str]] = []
        for t in range(turn + 1):
            draw = _mix(conversation * 1_000_033 + t)
            user = self._window(draw, _draw(_mix(draw), wl.prompt_tokens))
            reply_tokens = _draw(_mix(draw + 1), wl.max_tokens)
            if t == turn:
                return done, user, reply_tokens
            done.append((user, self._window(draw + 2, reply_tokens)))
        raise AssertionError  # the loop returns at its last turn

    def build(self, index: int) -> RequestSpec:
        """The request numbered `index` (0-based)."""
        wl = self.workload
        first = _mix(self.seed * 1_000_003 + index)
        body: dict[str, Any] = {}
        if self.model is not None:
            body["model"] = self.model
        max_tokens = _draw(first, wl.max_tokens)
        prompt: str | None
        messages: list[dict[str, Any]] | None
        if wl.conversations is not None:
            turns, user, max_tokens = self._conversation(index)
            if wl.api == "chat":
                messages = []
                for asked, answered in turns:
                    messages += [{"role": "user", "content": asked},
                                 {"role": "assistant", "content": answered}]
                messages.append({"role": "user", "content": user})
                prompt = None
            else:
                prompt = "".join(f"User: {asked}\nAssistant: {answered}\n"
                                 for asked, answered in turns) + f"User: {user}\nAssistant:"
                messages = None
        elif self.items is not None:
            item = self.items[index % len(self.items)]
            if item.max_tokens is not None:
                max_tokens = item.max_tokens
            prompt = item.prompt
            messages = list(item.messages) if item.messages is not None else None
        else:
            second = _mix(first)
            length = _draw(second, wl.prompt_tokens)
            start = _mix(second) % (len(self._pool) - length + 1)
            prompt = self._pool[start:start + length]
            messages = None
        if wl.api == "chat":
            body["messages"] = messages or [{"role": "user", "content": prompt or ""}]
        else:
            if prompt is None:  # a chat line used for completions: join the contents
                prompt = "\n".join(str(m.get("content", "")) for m in messages or [])
            body["prompt"] = prompt
        body["max_tokens"] = max_tokens
        body["temperature"] = wl.temperature
        body["stream"] = wl.stream
        if wl.stream:
            body["stream_options"] = {"include_usage": True}
        if wl.ignore_eos:
            body["ignore_eos"] = True
        if wl.min_tokens is not None:
            body["min_tokens"] = wl.min_tokens
        slot = index % len(self.targets)
        return RequestSpec(
            index=index, target=self.targets[slot], url=self._urls[slot],
            body=_encode(body),
            headers=self._headers, max_tokens=max_tokens,
        )
