"""Every exception of the proxy package, in one place.

`ChildCrashed` is an `FtctlError` (drawn in `dynamo_ftctl.errors`'s tree: exit 1); the
others never leave the package: the front door turns `ProxyError` into an HTTP error
answer, `StreamAborted` into a stream's error event and `RequestRejected` into a 400; the
policy reads `UpstreamFailure`'s outcome for the judgment::

    FtctlError
    └── ChildCrashed      a child of `proxy --procs N` died at start-up
    Exception
    ├── ProxyError        a failure before any output (status, OpenAI error body)
    ├── StreamAborted     a failure after output began (the error event's type)
    ├── NotContinuable    the generation cannot go on elsewhere (how to end it)
    ├── UpstreamFailure   an attempt ended without a whole answer (its `Outcome`)
    └── ScrapeFailed      a worker's or the daemon's page did not come
    ValueError
    ├── RequestRejected   the client's body cannot be served (the 400's `param`)
    ├── MalformedChunk    an upstream chunk that is not a completion chunk
    │   └── ErrorEvent    an SSE error event from the worker
    └── TemplateFailed    the chat template could not render the conversation
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.errors import FtctlError

if TYPE_CHECKING:
    from dynamo_ftctl.proxy.judgment import Outcome

__all__ = ["ChildCrashed", "ErrorEvent", "MalformedChunk", "NotContinuable", "ProxyError",
           "RequestRejected", "ScrapeFailed", "StreamAborted", "TemplateFailed",
           "UpstreamFailure"]


class ChildCrashed(FtctlError):
    """A child of `ftctl proxy --procs N` died at start-up (or never became ready): exit 1."""


class ProxyError(Exception):
    """A failure before any output: answered as an HTTP error."""

    def __init__(self, status: int, body: dict[str, Any],
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body
        self.headers = dict(headers or {})


class StreamAborted(Exception):
    """A failure after output began: ends the stream with an error event of type `kind`."""

    def __init__(self, message: str, kind: str = "worker_failed") -> None:
        super().__init__(message)
        self.kind = kind


class NotContinuable(Exception):
    """The generation cannot go on elsewhere; `finish_reason` says how to end it cleanly.

    `finish_reason` is "length" when the output reached max_tokens or the
    model's maximum length (a clean end), None when the request must end with
    an error (migration limit spent, n>1, ...).
    """

    def __init__(self, message: str, finish_reason: str | None = None) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


class UpstreamFailure(Exception):
    """The attempt ended without a whole answer; `outcome` says how, for `judgment.judge`.

    This room does not decide whose fault it was: the policy asks the judgment.
    """

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.message)
        self.outcome = outcome


class ScrapeFailed(Exception):
    """A scrape that got no page (the worker or the daemon answered another status)."""


class RequestRejected(ValueError):
    """The client's body cannot be served by the migrating proxy (HTTP 400).

    `param` names the offending field, as OpenAI's error body does.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class MalformedChunk(ValueError):
    """An upstream chunk that is not a valid completion chunk (garbage from a worker)."""


class ErrorEvent(MalformedChunk):
    """An SSE error event (`{"error": {...}}`); `status` is its HTTP-like code, if it has one.

    vLLM streams a request's own validation errors this way once the headers are
    out (`"code": 400`, type `BadRequestError`): those are the client's, not the
    worker's (`proxy` passes them on); other codes are failures of the worker.
    """

    def __init__(self, message: str, doc: dict[str, Any]) -> None:
        super().__init__(message)
        self.doc = doc
        self.status = _error_status(doc.get("error"))


class TemplateFailed(ValueError):
    """The template could not render this conversation (`raise_exception`, a Jinja error)."""


def _error_status(error: Any) -> int | None:
    """The code of an OpenAI error object as an HTTP status (400 for a named bad request)."""
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        return code
    if error.get("type") in ("invalid_request_error", "BadRequestError"):
        return 400
    return None
