"""The sim's tokenizers: a byte-level BPE (the default) and an exact byte tokenizer.

`BpeTokenizer` is what real engines have: a GPT-2-style byte-level BPE (through
the `tokenizers` library) trained on this repository's own text and shipped as
`tokenizer.json` beside this module. Every string encodes (bytes are the base
alphabet), and, as with every real BPE, a round trip through text is NOT exact:
generated ids such as `["the", " c", "at"]` decode to text that encodes to
other, longer merges (`["the", " cat"]`). A client that re-sends generated text
instead of generated ids presents the model with a different prompt; that is
the hazard a migrating proxy must survive, and the sim keeps it visible.
Incomplete UTF-8 decodes to U+FFFD, as Hugging Face's `decode` does. Lone
surrogates (`\\ud800` JSON escapes) are no text it can encode: `UnencodableText`
(Hugging Face's `encode` refuses them too; the server answers 400).

`ByteTokenizer` (`--tokenizer byte`) has ids 0..255 for bytes and an exact round
trip both ways (invalid UTF-8 decodes to lone surrogates, Python's
`surrogateescape`, and encodes back to the same bytes). The other lone surrogates
(U+D800-U+DC7F, U+DD00-U+DFFF) stand for no byte: `UnencodableText`.

Both share the specials (`<|bos|>` ... `<|end|>`, rendered as their names and
matched in text as Hugging Face does), the chat template, `token_text` for
logprobs and `IncrementalDetokenizer` for streamed text. Only `BpeTokenizer`
imports `tokenizers`, and only when one is built: the CLI never loads it.

`python -m dynamo_ftctl.engine.tokenizer --train OUT` regenerates the shipped
JSON byte for byte from the corpus pinned in `CORPUS_COMMIT`.
"""

from __future__ import annotations

import codecs
import functools
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dynamo_ftctl.engine.errors import UnencodableText
from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HfTokenizer

__all__ = [
    "ASSISTANT",
    "BOS",
    "BPE_JSON",
    "END",
    "EOS",
    "SPECIALS",
    "SPECIAL_NAMES",
    "SYSTEM",
    "USER",
    "VOCAB_SIZE",
    "BpeTokenizer",
    "ByteTokenizer",
    "IncrementalDetokenizer",
    "SimTokenizer",
    "load_tokenizer",
    "train_bpe",
]

TokenizerKind = Literal["bpe", "byte"]
SPECIAL_NAMES = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

# The byte tokenizer's ids (its specials follow the 256 bytes).
BOS, EOS, SYSTEM, USER, ASSISTANT, END = 256, 257, 258, 259, 260, 261
SPECIALS: dict[int, str] = dict(zip(range(256, 262), SPECIAL_NAMES, strict=True))
VOCAB_SIZE = 262

BPE_JSON = Path(__file__).with_name("tokenizer.json")
# The corpus is pinned to one commit so that later edits of the docs never change the
# tokenizer (and with it every recorded canary id).
CORPUS_COMMIT = "e4011808d71d6e5f5d4d7b935f39e3ff4852b1ad"
CORPUS_PATHS = (
    "README.md", "canaries/ftctl-sim-tiny.yaml", "man/ftctl.1", "man/ftctl-canary.1",
    "man/ftctl-drill.1", "man/ftctl-failover.1", "man/ftctl-gpu.1", "man/ftctl-inject.1",
    "man/ftctl-inventory.1", "man/ftctl-kv.1", "man/ftctl-load.1", "man/ftctl-lock.1",
    "man/ftctl-migrate.1", "man/ftctl-proxy.1", "man/ftctl-sim.1", "man/ftctl-xid.1",
)
# 1024 trained entries (256 bytes + 768 merges), like a real vocabulary scaled down: long
# enough for common words to be one token, small enough that the JSON stays ~50 KB.
BPE_TRAINED_SIZE = 1024
_ROLES = ("system", "user", "assistant")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# What `surrogateescape` cannot turn into a byte: the lone surrogates but U+DC80-U+DCFF.
_NOT_A_BYTE_RE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


class SimTokenizer:
    """What the engine and server need of a tokenizer; subclasses fill in the ids.

    `_bytes[i]` is token i's bytes, or None for a special; `_errors` says how
    undecodable bytes become text.
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    _bytes: list[bytes | None]
    _names: dict[int, str]
    _role_ids: dict[str, int]
    _end_id: int
    _errors: str
    _unencodable: re.Pattern[str]  # characters this tokenizer has no ids for

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, specials for their names; no BOS is added.

        Raises `UnencodableText` for a character it has no ids for.
        """
        raise NotImplementedError

    def check_encodable(self, text: str) -> None:
        """Raise `UnencodableText` when `encode(text)` would (without encoding it)."""
        match = self._unencodable.search(text)
        if match is not None:
            raise UnencodableText(text, match.start())

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; specials as their names."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            raw = self._raw(i)
            if raw is not None:
                run += raw
                continue
            if run:
                out.append(run.decode("utf-8", errors=self._errors))
                run.clear()
            out.append(self.special_name(i))
        if run:
            out.append(run.decode("utf-8", errors=self._errors))
        return "".join(out)

    def _raw(self, token_id: int) -> bytes | None:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else None

    def special_name(self, token_id: int) -> str:
        """A special's name (`<|eos|>`); ids outside the vocabulary as `<|id|>`."""
        return self._names.get(token_id, f"<|{token_id}|>")

    def token_text(self, token_id: int) -> str:
        """One token alone (for logprobs): its text, `bytes:\\xNN...` if not UTF-8, a special."""
        raw = self._raw(token_id)
        if raw is None:
            return self.special_name(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes of one token (OpenAI's `bytes` field); a special's name's bytes."""
        raw = self._raw(token_id)
        return list(raw if raw is not None else self.special_name(token_id).encode())

    def printable_ids(self) -> list[int]:
        """Tokens made only of printable ASCII and newlines (the model favours them)."""
        return [i for i, raw in enumerate(self._bytes)
                if raw and all(32 <= b < 127 or b == 10 for b in raw)]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Ids of a chat: `<|role|>content<|end|>` per message, then `<|assistant|>`.

        With `continue_final_message` the last message is left open (no `<|end|>`)
        so that the model extends it, as vLLM does.
        """
        ids = [self.bos_id]
        user = self._role_ids["user"]
        for position, message in enumerate(messages):
            ids.append(self._role_ids.get(message.get("role", "user"), user))
            ids.extend(self.encode(message.get("content") or ""))
            last = position == len(messages) - 1
            if not (last and continue_final_message):
                ids.append(self._end_id)
        if add_generation_prompt and not continue_final_message:
            ids.append(self._role_ids["assistant"])
        return ids


class ByteTokenizer(SimTokenizer):
    """UTF-8 bytes as ids; specials render as `<|name|>`; exact round trips."""

    _errors = "surrogateescape"
    _unencodable = _NOT_A_BYTE_RE
    _special_re = re.compile("|".join(re.escape(name) for name in SPECIAL_NAMES))

    def __init__(self) -> None:
        self.vocab_size, self.bos_id, self.eos_id = VOCAB_SIZE, BOS, EOS
        self._bytes = [bytes((b,)) for b in range(256)]
        self._names = SPECIALS
        self._role_ids = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
        self._end_id = END
        self._by_name = {name: token for token, name in SPECIALS.items()}

    def encode(self, text: str) -> list[int]:
        """Ids of `text`: its UTF-8 bytes, specials for their names; no BOS is added."""
        try:
            if "<|" not in text:
                return list(text.encode("utf-8", errors="surrogateescape"))
            ids: list[int] = []
            start = 0
            for match in self._special_re.finditer(text):
                ids.extend(text[start : match.start()].encode("utf-8", errors="surrogateescape"))
                ids.append(self._by_name[match.group()])
                start = match.end()
            ids.extend(text[start:].encode("utf-8", errors="surrogateescape"))
        except UnicodeEncodeError:
            self.check_encodable(text)  # names the character
            raise
        return ids

    def token_text(self, token_id: int) -> str:
        """One token alone (for logprobs): a printable byte, `bytes:\\xNN`, or a special."""
        if 0 <= token_id < 128:
            return chr(token_id)
        return super().token_text(token_id)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable stand-in char -> its byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in visible}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class BpeTokenizer(SimTokenizer):
    """A byte-level BPE from a `tokenizers` JSON (default: the shipped one)."""

    _errors = "replace"
    _unencodable = _SURROGATE_RE

    def __init__(self, path: Path = BPE_JSON) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            msg = ("the sim's BPE tokenizer needs the `tokenizers` package: "
                   "pip install 'dynamo-ftctl[sim]' (or run with --tokenizer byte)")
            raise InvalidInput(msg) from None
        self._tok: HfTokenizer = Tokenizer.from_file(str(path))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        by_id = {i: s for s, i in vocab.items()}
        added = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        byte_of = _byte_of_char()
        self._bytes = [None if i in added or i not in by_id
                       else bytes(byte_of[c] for c in by_id[i]) for i in range(self.vocab_size)]
        self._names = {i: by_id[i] for i in added}
        ids = {name: vocab[name] for name in SPECIAL_NAMES}
        self.bos_id, self.eos_id = ids["<|bos|>"], ids["<|eos|>"]
        self._role_ids = {role: ids[f"<|{role}|>"] for role in _ROLES}
        self._end_id = ids["<|end|>"]

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, specials for their names; no BOS is added.

        Lone surrogates (`\\udcXX` JSON escapes) are not text the library takes
        (its `encode` raises TypeError): `UnencodableText`.
        """
        self.check_encodable(text)
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(kind: TokenizerKind = "bpe") -> SimTokenizer:
    """The sim's tokenizer by name: `bpe` (the shipped BPE) or `byte`."""
    return ByteTokenizer() if kind == "byte" else _shipped_bpe()


@functools.cache
def _shipped_bpe() -> BpeTokenizer:
    # Immutable after construction: engines in one process (tests) share one.
    return BpeTokenizer()


class IncrementalDetokenizer:
    """Text deltas for a stream of ids: a multi-byte character appears once complete.

    The concatenation of all deltas (after `flush`) equals `tokenizer.decode(all ids)`;
    a character split across tokens never leaves as a broken half.

    `context` is the prompt's ids: its last few bytes are read first, output dropped, as
    vLLM's detokenizer reads the prompt's tail. A continuation (prompt ids + the ids
    generated before a failure) then completes a character whose first bytes the failed
    worker held back, and its text is the uninterrupted run's from the cut on.
    """

    def __init__(self, tokenizer: SimTokenizer, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors=tokenizer._errors)
        # A character is at most 4 bytes, and every id holds at least one byte or a special.
        for token_id in context[-3:]:
            raw = tokenizer._raw(token_id)
            if raw is None:
                self._decoder.reset()
            else:
                self._decoder.decode(raw)

    def push(self, token_id: int) -> str:
        """The text this token completes ("" for the first bytes of a character)."""
        raw = self._tokenizer._raw(token_id)
        if raw is not None:
            return self._decoder.decode(raw)
        return self.flush() + self._tokenizer.special_name(token_id)

    def flush(self) -> str:
        """Whatever incomplete bytes remain (decoded with the tokenizer's error mode)."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


# ---------------------------------------------------------------------------
# Training (a development step: the result ships in the package)


def _corpus(repo: Path) -> list[str]:
    """The pinned corpus files' text, read from git at `CORPUS_COMMIT`."""
    texts = []
    for path in CORPUS_PATHS:
        shown = subprocess.run(
            ["git", "-C", str(repo), "show", f"{CORPUS_COMMIT}:{path}"],
            capture_output=True, check=True)
        texts.append(shown.stdout.decode())
    return texts


def train_bpe(texts: Sequence[str]) -> str:
    """The tokenizer JSON trained on `texts`: byte-level BPE, then the specials on top."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_TRAINED_SIZE, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    # Specials after the trained vocabulary, as real models place them (Llama 3: 128000+).
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for name in SPECIAL_NAMES])
    return tok.to_str(pretty=True) + "\n"


def main(argv: Sequence[str]) -> int:
    """`python -m dynamo_ftctl.engine.tokenizer --train OUT [--repo DIR]`."""
    args = list(argv)
    if len(args) not in (2, 4) or args[0] != "--train" or (len(args) == 4 and args[2] != "--repo"):
        sys.stderr.write(f"usage: python -m {__spec__.name if __spec__ else __name__} "
                         "--train OUT [--repo DIR]\n")
        return 2
    repo = Path(args[3]) if len(args) == 4 else Path.cwd()
    from dynamo_ftctl.safefiles import write_atomic

    write_atomic(Path(args[1]), train_bpe(_corpus(repo)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
