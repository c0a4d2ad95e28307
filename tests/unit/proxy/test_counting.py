"""Token counts without token ids (issue 31): a worker's usage chunk, /tokenize or a local
tokenizer settle what text chunks undercount, across a cut and a text continuation."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.proxy.balancer import WorkerSlot
from dynamo_ftctl.proxy.continuation import continuation_request, first_request
from dynamo_ftctl.proxy.counting import TokenCounter, weakest
from dynamo_ftctl.proxy.ledger import StreamLedger

PROMPT_TOKENS = 7  # what the test's worker says the prompt "hello" is


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "up", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"id": "up", "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion}}


def _chunks(groups: list[tuple[int, bool]], start: int) -> list[str]:
    """Dynamo's chunks of consecutive tokens (one character each), by groups: a group of k
    tokens is k-1 empty chunks and one with the k characters (`empties`), or one chunk of k
    tokens."""
    texts: list[str] = []
    position = start
    for size, empties in groups:
        text = "".join(chr(97 + (position + i) % 26) for i in range(size))
        position += size
        texts.extend([""] * (size - 1) if empties else [])
        texts.append(text)
    return texts


groups_st = st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(groups=groups_st, cut=st.integers(0, 200), spare=st.integers(0, 5),
       cont_groups=st.lists(st.tuples(st.integers(1, 4), st.booleans()), max_size=10))
def test_any_chunking_and_any_cut_counts_every_token_once_within_max_tokens(
        groups: list[tuple[int, bool]], cut: int, spare: int,
        cont_groups: list[tuple[int, bool]]) -> None:
    """However tokens fall into chunks (several a chunk, empty chunks) and wherever the
    stream is cut, the client's completion_tokens is the tokens it was given and the
    tokens asked of all workers never pass its max_tokens; prompt_tokens is the prompt's."""
    generated = sum(size for size, _ in groups)
    max_tokens = generated + spare
    ledger = StreamLedger(endpoint="completions", body={
        "model": "m", "prompt": "hello", "max_tokens": max_tokens, "stream": True})
    asked = first_request(ledger)["max_tokens"]
    assert asked == max_tokens
    texts = _chunks(groups, 0)
    ledger.start_attempt("w0")
    if cut >= len(texts):  # no failure: the worker finishes and says its usage
        for i, text in enumerate(texts):
            ledger.observe(_chunk(text, "length" if i == len(texts) - 1 else None))
        ledger.observe(_usage(PROMPT_TOKENS, generated))
        usage = ledger.usage()
        assert (usage.completion_tokens, usage.prompt_tokens) == (generated, PROMPT_TOKENS)
        assert ledger.count_source == "usage"
        return
    for text in texts[:cut]:
        ledger.observe(_chunk(text))
    delivered = len(ledger.generated_text)  # one character a token: what the client has
    assert ledger.count_unsettled or delivered == 0
    # The policy settles the cut attempt with an exact counter (one token a character).
    if ledger.count_unsettled:
        ledger.settle_attempt(len(ledger.attempt_text), "tokenizer")
    assert ledger.generated_count == delivered
    if delivered >= max_tokens:
        return  # complete by length: no continuation
    body = continuation_request(ledger)
    ledger.note_migration()
    remaining = body["max_tokens"]
    assert delivered + remaining <= max_tokens
    assert delivered + remaining == max_tokens
    # The next worker generates what it is asked; its usage counts its prompt with the
    # re-sent text in it.
    ledger.start_attempt("w1")
    cont = _chunks(cont_groups, delivered) if cont_groups else []
    produced = len("".join(cont))
    if produced > remaining or not cont:
        cont = ["x"] * remaining
        produced = remaining
    for i, text in enumerate(cont):
        ledger.observe(_chunk(text, "length" if i == len(cont) - 1 else None))
    prompt_seen = PROMPT_TOKENS + (delivered if ledger.generated_count - ledger.attempt_tokens
                                   else 0)
    ledger.observe(_usage(prompt_seen, produced))
    usage = ledger.usage()
    assert usage.completion_tokens == delivered + produced
    assert usage.completion_tokens <= max_tokens
    if delivered:
        assert usage.prompt_tokens == PROMPT_TOKENS  # not the continuation's
        assert ledger.count_source in ("tokenizer", "usage")


def test_chunks_alone_undercount_and_say_so() -> None:
    """A worker that sends no usage, with no counter: the count is chunks, and named so."""
    ledger = StreamLedger(endpoint="completions", body={
        "model": "m", "prompt": "hi", "max_tokens": 10, "stream": True})
    ledger.start_attempt("w0")
    for text in ["", "ab", "c"]:
        ledger.observe(_chunk(text))
    assert ledger.generated_count == 2
    assert ledger.count_source == "chunks"
    assert weakest(["ids", "usage", "chunks", "tokenize"]) == "chunks"


def test_ids_count_stands_and_a_usage_chunk_does_not_change_it() -> None:
    """With ids each id is a token: the worker's usage is not needed."""
    ledger = StreamLedger(endpoint="completions", body={
        "model": "m", "prompt": "hi", "max_tokens": 10, "stream": True})
    ledger.start_attempt("w0")
    ledger.observe({"id": "up", "choices": [
        {"index": 0, "text": "ab", "token_ids": [1, 2], "finish_reason": "length"}]})
    ledger.observe(_usage(2, 99))
    assert ledger.usage().completion_tokens == 2
    assert ledger.count_source == "ids"


def test_a_settled_count_never_passes_max_tokens_nor_drops_below_the_chunks() -> None:
    """A counter that says too much or too little is held between the chunks and the limit."""
    ledger = StreamLedger(endpoint="completions", body={
        "model": "m", "prompt": "hi", "max_tokens": 5, "stream": True})
    ledger.start_attempt("w0")
    for text in ["a", "b", "c"]:
        ledger.observe(_chunk(text))
    ledger.settle_attempt(1, "tokenize")
    assert ledger.generated_count == 3
    ledger.settle_attempt(50, "tokenize")
    assert ledger.generated_count == 5


def test_local_tokenizer_counts_text_and_a_bad_path_counts_nothing(tmp_path: Path) -> None:
    """The inventory's tokenizer (the sim's BPE file) counts; a missing file is None."""
    shipped = Path(__file__).parents[3] / "src/dynamo_ftctl/engine/tokenizer.json"
    slot = WorkerSlot(name="w0", url="http://127.0.0.1:1", model="m", group="g")
    counter = TokenCounter(None, {"w0": shipped})
    found = asyncio.run(counter.count([slot], "m", text="hello world, hello world"))
    assert found is not None
    assert found[1] == "tokenizer"
    assert 1 <= found[0] <= len("hello world, hello world")
    broken = TokenCounter(None, {"w0": tmp_path / "nothing"})
    assert asyncio.run(broken.count([slot], "m", text="hi")) is None


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_hostile_tokenizer_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    """A FIFO where tokenizer.json should be (which `Tokenizer.from_file` would block on,
    the proxy's event loop with it), or a link to one elsewhere: not loaded, the chunk
    count stands, at once."""
    folder = tmp_path / "tok"
    folder.mkdir()
    if kind == "fifo":
        os.mkfifo(folder / "tokenizer.json")
    else:
        (tmp_path / "real.json").write_text("{}")
        (folder / "tokenizer.json").symlink_to(tmp_path / "real.json")
    counter = TokenCounter(None, {"w0": folder})
    assert counter._tokenizer(folder) is None  # a blocking open hangs: the test times out
