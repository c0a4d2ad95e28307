"""Token counts of text, for workers that return no token ids (Dynamo, strict servers).

Without ids the ledger counts one token per non-empty text chunk, a lower bound:
Dynamo's detokenizer merges a token that ends inside a character into the next
chunk (one chunk, two tokens) and sends an empty chunk for it. The exact count of
an attempt comes from, in this order:

- `usage`: the worker's own usage chunk (every upstream request asks for it);
  the ledger takes it (`StreamLedger.observe`), and this module is not asked;
- `tokenize`: POST /tokenize on a worker of the model that has it (vLLM, SGLang),
  for an attempt that ended without its usage chunk (a worker killed mid-stream);
- `tokenizer`: the tokenizer the inventory names for the worker (`tokenizer:`, a
  directory holding `tokenizer.json`, or that file), loaded once with the
  `tokenizers` library (the `tokenizer` extra), never at import;
- `chunks`: none of them: the chunk count stands.

`TokenCounter.count` never raises: a source that fails is skipped. It owns no
decision: the migration policy asks it when an attempt's count is not settled.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.proxy.codec import dumps, loads

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.proxy.balancer import WorkerSlot
    from dynamo_ftctl.proxy.chat_template import ChatTemplate

__all__ = ["COUNT_SOURCES", "CountSource", "TokenCounter", "weakest"]

log = logging.getLogger("ftctl.proxy")

CountSource = Literal["ids", "usage", "tokenize", "tokenizer", "chunks"]
# Strongest first: a request's count is as good as its weakest attempt's.
COUNT_SOURCES: tuple[CountSource, ...] = ("ids", "usage", "tokenize", "tokenizer", "chunks")
# A /tokenize answer is waited for this long: the continuation waits on it.
_TOKENIZE_TIMEOUT_S = 2.0


def weakest(sources: Iterable[CountSource]) -> CountSource:
    """The weakest of `sources` ("ids" for none)."""
    return max(sources, key=COUNT_SOURCES.index, default="ids")


class TokenCounter:
    """Counts text in tokens through a worker's /tokenize or a local tokenizer.

    `tokenizers` maps a worker's name to its tokenizer path (the inventory's
    `tokenizer:`); each file is loaded on first use and kept.
    """

    def __init__(self, http: Client | None, tokenizers: Mapping[str, Path]) -> None:
        self.http = http
        self.tokenizers = dict(tokenizers)
        self._loaded: dict[Path, Any] = {}
        self._broken: set[Path] = set()
        self._templates: dict[Path, ChatTemplate | None] = {}

    async def count(self, slots: Iterable[WorkerSlot], model: str | None, *,
                    text: str | None = None, messages: list[Any] | None = None,
                    ) -> tuple[int, CountSource] | None:
        """Tokens in `text` (or in the chat `messages`, rendered by the worker's template:
        /tokenize only), by the first source that answers among `slots`' workers."""
        candidates = list(slots)
        for slot in candidates:
            if slot.tokenize and self.http is not None:
                counted = await self._tokenize(slot, model, text, messages)
                if counted is not None:
                    return counted, "tokenize"
        if text is None:
            return None
        for slot in candidates:
            path = self.tokenizers.get(slot.name)
            if path is None:
                continue
            tokenizer = self._tokenizer(path)
            if tokenizer is not None:
                return len(tokenizer.encode(text, add_special_tokens=False).ids), "tokenizer"
        return None

    async def _tokenize(self, slot: WorkerSlot, model: str | None, text: str | None,
                        messages: list[Any] | None) -> int | None:
        body: dict[str, Any] = {"add_special_tokens": False}
        if model is not None:
            body["model"] = model
        if text is not None:
            body["prompt"] = text
        elif messages is not None:
            body["messages"] = messages
        else:
            return None
        assert self.http is not None
        try:
            resp = await self.http.request(
                "POST", f"{slot.url}/tokenize", dumps(body),
                {"Content-Type": "application/json"},
                connect_timeout_s=_TOKENIZE_TIMEOUT_S, head_timeout_s=_TOKENIZE_TIMEOUT_S)
            try:
                data = await resp.read(16 * 1024 * 1024, timeout_s=_TOKENIZE_TIMEOUT_S)
            finally:
                resp.close()
            if resp.status != 200:
                return None
            doc = loads(data)
        except (OSError, TimeoutError, ValueError) as exc:
            log.debug("POST %s/tokenize failed: %s", slot.url, exc)
            return None
        if not isinstance(doc, dict):
            return None
        count = doc.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
        tokens = doc.get("tokens")
        return len(tokens) if isinstance(tokens, list) else None

    def _tokenizer(self, path: Path) -> Any:
        """The `tokenizers.Tokenizer` at `path` (a directory with tokenizer.json, or the
        file), loaded once; None when it cannot be (said once in the log)."""
        if path in self._loaded:
            return self._loaded[path]
        if path in self._broken:
            return None
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            from tokenizers import Tokenizer

            # Read as a regular file of one name, bounded (a FIFO would block the loop,
            # a link lead elsewhere), then parsed from memory.
            tokenizer = Tokenizer.from_str(_read_bounded(file, _TOKENIZER_MAX))
        except ImportError:
            log.warning("tokenizer %s not loaded: the tokenizers library is missing "
                        "(pip install 'dynamo-ftctl[tokenizer]'); counting text chunks", file)
            tokenizer = None
        except Exception as exc:  # the library raises its own errors for a bad file
            log.warning("tokenizer %s not loaded (%s); counting text chunks", file, exc)
            tokenizer = None
        if tokenizer is None:
            self._broken.add(path)
        else:
            self._loaded[path] = tokenizer
        return tokenizer

    def chat_template(self, slots: Iterable[WorkerSlot]) -> ChatTemplate | None:
        """The chat template of the tokenizer directory the inventory names for one of
        `slots`' workers (they serve one model), loaded once; None when none names one or
        it has no usable template (said once in the log)."""
        for slot in slots:
            path = self.tokenizers.get(slot.name)
            if path is None:
                continue
            folder = path if path.is_dir() else path.parent
            if folder in self._templates:
                found = self._templates[folder]
            else:
                from dynamo_ftctl.errors import FtctlError
                from dynamo_ftctl.proxy.chat_template import ChatTemplate

                try:
                    found = ChatTemplate.from_directory(folder)
                except (FtctlError, OSError, ImportError) as exc:
                    log.warning("%s: no chat template for continuing chats (%s)", folder, exc)
                    found = None
                self._templates[folder] = found
            if found is not None:
                return found
        return None


# A tokenizer.json is a few MB (a 256k vocabulary ~30 MB); past this it is not one.
_TOKENIZER_MAX = 256 * 1024 * 1024


def _read_bounded(path: Path, limit: int) -> str:
    """`path`'s text, read as a regular file of one name, at most `limit` bytes
    (`safefiles.read_regular`)."""
    from dynamo_ftctl.safefiles import read_regular

    return read_regular(path, limit).decode("utf-8")
