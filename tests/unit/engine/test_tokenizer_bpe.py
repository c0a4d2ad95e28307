"""The sim's default BPE tokenizer: shipped JSON, real-BPE round trips, specials, streaming."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.engine.config import EngineConfig
from dynamo_ftctl.engine.errors import UnencodableText
from dynamo_ftctl.engine.tokenizer import (
    BPE_JSON,
    CORPUS_COMMIT,
    SPECIAL_NAMES,
    ByteTokenizer,
    IncrementalDetokenizer,
    load_tokenizer,
    main,
)
from dynamo_ftctl.errors import InvalidInput

pytest.importorskip("tokenizers")

TOK = load_tokenizer("bpe")
REPO = Path(__file__).resolve().parents[3]
# Text without lone surrogates: what a JSON string of real text decodes to.
TEXT = st.text(st.characters(exclude_categories=("Cs",)))


def _has_corpus_commit() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{CORPUS_COMMIT}^{{commit}}"],
                           capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _has_corpus_commit(), reason="needs git and the corpus commit")
def test_training_regenerates_the_shipped_json(tmp_path: Path) -> None:
    """`--train` rebuilds tokenizer.json byte for byte from the pinned corpus."""
    out = tmp_path / "tokenizer.json"
    assert main(["--train", str(out), "--repo", str(REPO)]) == 0
    assert out.read_bytes() == BPE_JSON.read_bytes()


def test_train_usage_is_exit_two(capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong command line prints the usage and exits 2."""
    assert main(["--frobnicate"]) == 2
    assert "--train OUT" in capsys.readouterr().err


def test_vocabulary_is_subwords_then_specials() -> None:
    """1024 trained entries (bytes and merges), the six specials after them."""
    assert TOK.vocab_size == 1030
    assert [TOK.special_name(1024 + i) for i in range(6)] == list(SPECIAL_NAMES)
    assert TOK.eos_id == 1025
    words = TOK.encode("The capital of France is")
    assert len(words) < len(b"The capital of France is")  # merges, not bytes
    assert TOK.decode(words) == "The capital of France is"


@given(TEXT)
def test_text_round_trips(text: str) -> None:
    """Every string encodes, and decoding its ids gives it back."""
    ids = TOK.encode(text)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


def test_generated_ids_retokenize_to_other_ids() -> None:
    """Ids a model may emit one byte at a time decode to text that encodes as merges."""
    generated = [TOK.encode(ch)[0] for ch in " capital"]
    text = TOK.decode(generated)
    assert text == " capital"
    assert TOK.encode(text) != generated
    assert len(TOK.encode(text)) < len(generated)


@given(st.lists(st.integers(0, 1029), max_size=64))
def test_incremental_detokenizer_matches_decode(ids: list[int]) -> None:
    """Streamed text deltas join to the same text as decoding all ids at once."""
    detok = IncrementalDetokenizer(TOK)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == TOK.decode(ids)


@given(st.lists(st.integers(0, 1029), max_size=64), st.data())
def test_a_continuation_with_the_prompt_as_context_gives_the_uninterrupted_text(
        ids: list[int], data: st.DataObject) -> None:
    """Deltas of ids[:k] (without the held-back bytes a failed worker never sent), then
    those of ids[k:] with ids[:k] as context, join to the uninterrupted stream's text."""
    cut = data.draw(st.integers(0, len(ids)))
    whole = IncrementalDetokenizer(TOK)
    expected = "".join(whole.push(i) for i in ids) + whole.flush()
    before = IncrementalDetokenizer(TOK)
    head = "".join(before.push(i) for i in ids[:cut])
    after = IncrementalDetokenizer(TOK, ids[:cut])
    assert head + "".join(after.push(i) for i in ids[cut:]) + after.flush() == expected


def test_a_character_split_across_tokens_leaves_whole() -> None:
    """The four byte tokens of an emoji give three empty deltas, then the whole character."""
    ids = TOK.encode("🙂")
    assert len(ids) == 4
    detok = IncrementalDetokenizer(TOK)
    assert [detok.push(i) for i in ids] == ["", "", "", "🙂"]
    assert detok.flush() == ""


def test_incomplete_utf8_decodes_to_replacement_characters() -> None:
    """Half a character decodes to U+FFFD (as Hugging Face's decode), never a surrogate."""
    half = TOK.encode("é")[:1]
    assert TOK.decode(half) == "\ufffd"
    assert TOK.token_text(half[0]) == "bytes:\\xc3"
    assert TOK.token_bytes(half[0]) == [0xC3]


@pytest.mark.parametrize("text", ["a\udcff", "\ud800", "ok\udfff!"])
def test_lone_surrogates_are_no_text_to_encode(text: str) -> None:
    """A lone surrogate (a `\\ud800` JSON escape) is `UnencodableText` naming where, as
    Hugging Face's own encode refuses it: never an encoding that guesses."""
    with pytest.raises(UnencodableText, match="lone surrogate") as caught:
        TOK.encode(text)
    assert caught.value.index == next(i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff")


def test_specials_from_their_names_and_back() -> None:
    """Special names in text are the specials; their token text is the name."""
    ids = TOK.encode("hi<|eos|>")
    assert ids[-1] == TOK.eos_id
    assert TOK.token_text(TOK.eos_id) == "<|eos|>"
    assert TOK.token_bytes(TOK.eos_id) == list(b"<|eos|>")
    assert TOK.decode(ids) == "hi<|eos|>"


def test_chat_template_and_continuation() -> None:
    """`<|role|>content<|end|>` per message; a continued final message stays open."""
    bos, user, assistant, end = (TOK.encode(n)[0] for n in (
        "<|bos|>", "<|user|>", "<|assistant|>", "<|end|>"))
    messages = [{"role": "user", "content": "hello"}]
    hello = TOK.encode("hello")
    assert TOK.apply_chat_template(messages) == [bos, user, *hello, end, assistant]
    cont = [*messages, {"role": "assistant", "content": " world"}]
    ids = TOK.apply_chat_template(cont, add_generation_prompt=False, continue_final_message=True)
    assert ids == [bos, user, *hello, end, assistant, *TOK.encode(" world")]


def test_printable_ids_are_ascii_tokens() -> None:
    """The model favours tokens of printable ASCII and newlines, not specials or raw bytes."""
    printable = set(TOK.printable_ids())
    assert TOK.encode(" the")[0] in printable
    assert TOK.encode("\n")[0] in printable
    assert TOK.eos_id not in printable
    assert TOK.encode("é")[0] not in printable


def test_byte_tokenizer_stays_available() -> None:
    """`--tokenizer byte` gives the exact byte tokenizer."""
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_engine_vocabulary_follows_the_tokenizer() -> None:
    """The model's vocabulary is the tokenizer's unless pinned; too small is refused."""
    pytest.importorskip("torch")
    from dynamo_ftctl.engine.scheduler import Engine

    small = {"d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8,
             "ffn_dim": 16, "num_blocks": 8}
    assert Engine(EngineConfig(**small)).config.vocab_size == 1030
    assert Engine(EngineConfig(**small, tokenizer="byte")).config.vocab_size == 262
    with pytest.raises(InvalidInput, match="vocab_size 300 is smaller"):
        Engine(EngineConfig(**small, vocab_size=300))
