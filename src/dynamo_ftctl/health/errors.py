"""Every exception of the health package, in one place; none leaves it.

A probe's callers meet only `dynamo_ftctl.errors` classes: `record`, `probe` and the
daemon translate these into `Unreachable` (exit 3), `CheckFailed` (exit 1) or a
verdict::

    http1.HttpError
    └── TransportError    the POST failed before a complete response (`kind` says how)
    Exception
    ├── BadResponse       the worker answered, but not with a usable completion
    └── TokenIdsRefused   the worker refused the `return_token_ids` field

It imports only `http1.errors` (no asyncio), so the one-shot probe pays nothing for it.
"""

from __future__ import annotations

from typing import Literal

from dynamo_ftctl.http1.errors import HttpError

__all__ = ["BadResponse", "FailureKind", "TokenIdsRefused", "TransportError"]

FailureKind = Literal["refused", "timeout", "reset", "too_large", "endless_body", "protocol"]


class TransportError(HttpError):
    """The exchange failed before a complete response; `transient` ones may be retried."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    @property
    def transient(self) -> bool:
        """A connection reset mid-exchange may pass; refusals and timeouts are verdicts."""
        return self.kind == "reset"

    @property
    def unreachable(self) -> bool:
        """No answer at all (as opposed to a wrong or unbounded one)."""
        return self.kind in ("refused", "timeout", "reset")


class BadResponse(Exception):
    """The worker answered, but not with a usable completion."""


class TokenIdsRefused(Exception):
    """The worker refused the `return_token_ids` field (a strict OpenAI server): `record`
    asks again for text only."""
