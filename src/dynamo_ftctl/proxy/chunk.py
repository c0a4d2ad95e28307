"""The upstream chunk: what a worker's streamed completion chunk must look like.

The ledger (`proxy/ledger.py`) reads every chunk through these checks: a chunk that
is not a valid completion chunk is `MalformedChunk` (garbage from a worker), an SSE
error event is `ErrorEvent`. A chat continued through /v1/completions streams
completion chunks that reach the client in chat form (`chat_choice`,
`chat_logprobs`). Pure code: no I/O.
"""

from __future__ import annotations

from typing import Any

from dynamo_ftctl.proxy.errors import ErrorEvent, MalformedChunk

__all__ = ["MAX_TOKEN_ID", "ErrorEvent", "MalformedChunk", "chat_choice", "chat_logprobs",
           "choice_of", "int_list", "token_ids"]

# Token ids are at most this (exclusive): engines keep them in 32-bit integers (vLLM's
# int32 tensors), and no vocabulary comes near it.
MAX_TOKEN_ID = 2**31


def choice_of(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The chunk's one choice; None when `choices` is empty (a usage chunk). `MalformedChunk`
    when `choices` is not a list of objects or holds more than choice 0."""
    choices = doc.get("choices")
    if not isinstance(choices, list):
        raise MalformedChunk("chunk has no 'choices' list")
    if not choices:
        return None
    first = choices[0]
    if not isinstance(first, dict):
        raise MalformedChunk("choice is not an object")
    if len(choices) > 1 or first.get("index", 0) != 0:
        raise MalformedChunk("more than one choice in a stream of n=1")
    return first


_INT = {int}


def token_ids(value: Any, what: str) -> list[int] | None:
    """A worker's token ids, or None when one is out of [0, `MAX_TOKEN_ID`): a worker that
    lies about ids is read as one without ids (text), never relayed. `MalformedChunk` when
    `value` is not a list of integers at all."""
    ids = int_list(value, what)
    if ids and (min(ids) < 0 or max(ids) >= MAX_TOKEN_ID):
        return None
    return ids


def int_list(value: Any, what: str) -> list[int]:
    """`value` itself when it is a list of integers (bools excluded); `MalformedChunk`
    naming `what` otherwise."""
    # Fast path for what a JSON decoder gives: a list of exact ints, checked in C
    # (a fraction of the generator's cost below on a prompt's ids).
    if type(value) is list and (not value or set(map(type, value)) == _INT):
        return value
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MalformedChunk(f"{what} is not a list of integers")
    return value


def chat_choice(choice: dict[str, Any], text: Any) -> dict[str, Any]:
    """A completion chunk's choice in the form of a chat chunk's (a chat continued by ids)."""
    out = {k: v for k, v in choice.items() if k not in ("text", "logprobs")}
    out["delta"] = {"content": text} if text else {}
    out["logprobs"] = chat_logprobs(choice.get("logprobs"))
    return out


def chat_logprobs(logprobs: Any) -> dict[str, Any] | None:
    """Completions logprobs (`tokens`, `token_logprobs`, `top_logprobs`) in chat's layout.

    Chat's `content` entries carry each token's text, its logprob, its UTF-8 bytes and
    the alternatives as entries of their own (OpenAI's chat logprobs object).
    """
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens")
    values = logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    tops = logprobs.get("top_logprobs")
    if not isinstance(tops, list):
        tops = [None] * len(tokens)

    def entry(token: Any, value: Any) -> dict[str, Any]:
        text = str(token)
        return {"token": text, "logprob": value,
                "bytes": list(text.encode("utf-8", "surrogatepass"))}

    content = []
    for token, value, top in zip(tokens, values, tops, strict=False):
        item = entry(token, value)
        item["top_logprobs"] = [entry(t, v) for t, v in top.items()] \
            if isinstance(top, dict) else []
        content.append(item)
    return {"content": content}
