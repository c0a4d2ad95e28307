"""Every exception of `ftctl sim`'s engine and server, in one place.

Two refuse bad input and are `InvalidInput` (exit 2 from the CLI, an OpenAI 400 from
the server); they are drawn in `dynamo_ftctl.errors`' tree::

    InvalidInput
    ├── ParamError        a request field the sim refuses (the 400 names the field)
    └── UnencodableText   text with a character the tokenizer has no ids for

The other three never leave the engine package: the driver and the server catch them::

    Exception
    ├── DroppedByFault    raised inside a stream to drop its connection (`disconnect` fault)
    └── StreamFailed      the engine ended a request with an error (500, or 503 asleep)
    RuntimeError
    └── BatchDeath        a step that ends every request of its batch (the poison fault)

This module imports nothing but `dynamo_ftctl.errors`, so raising or catching these
never loads torch.
"""

from __future__ import annotations

from dynamo_ftctl.errors import InvalidInput

__all__ = ["BatchDeath", "DroppedByFault", "ParamError", "StreamFailed", "UnencodableText"]


class ParamError(InvalidInput):
    """A request field the sim refuses (400 naming `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnencodableText(InvalidInput):
    """Text with a character the tokenizer has no ids for (a lone surrogate)."""

    def __init__(self, text: str, index: int) -> None:
        self.index = index
        super().__init__(f"U+{ord(text[index]):04X} at character {index} is a lone "
                         "surrogate, not text the tokenizer can encode")


class DroppedByFault(Exception):
    """Raised inside a stream to drop its connection (the `disconnect` fault)."""


class StreamFailed(Exception):
    """The engine ended a request with an error (aborted, engine asleep); `status` is the
    answer's (500, or 503 while asleep)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class BatchDeath(RuntimeError):
    """A step that ends every request of its batch (the poison fault), not one alone."""
