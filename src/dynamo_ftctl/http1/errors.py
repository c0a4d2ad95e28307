"""The errors of the http1 client: all `HttpError` (an `OSError`, as connection errors are).

The tree is drawn in `dynamo_ftctl.http1`'s docstring; timeouts are the built-in
`TimeoutError`.
"""

from __future__ import annotations

__all__ = ["BodyTooLarge", "ConnectError", "ConnectTimeout", "ConnectionBroken", "HttpError",
           "NoConnection", "ProtocolError"]


class HttpError(OSError):
    """The exchange failed below HTTP's status codes."""


class ConnectError(HttpError):
    """No answer began: refused, unreachable, or closed before its first byte."""


class NoConnection(ConnectError):
    """No connection was made (refused, unreachable): the server never saw the request.

    Not `dynamo_ftctl.errors.Unreachable` (exit 3): callers translate this one into that.
    """


class ConnectTimeout(NoConnection, TimeoutError):
    """No connection within the connect timeout: a `NoConnection` (the server never saw
    the request) and a `TimeoutError` (callers that only tell timeouts apart see one)."""


class ConnectionBroken(HttpError):
    """The connection closed or reset after the answer began."""


class ProtocolError(HttpError):
    """What came back is not HTTP/1.1 (or its body framing is broken)."""


class BodyTooLarge(HttpError):
    """A body read whole was larger than its limit."""
