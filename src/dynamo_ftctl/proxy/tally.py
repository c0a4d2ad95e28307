"""The proxy's request series, counted as Dynamo's frontend counts its own.

One `RequestTally` per generation request (`frontdoor.FrontDoor`): the time to first
token is observed once, when the first batch reaches the proxy; the request counter,
the duration and the inter-token latency once, when the request ends. The hot path
never touches a Prometheus object per token: the inter-token latency is the request's
mean gap between tokens (first token to end, over tokens less one), observed once for
each gap (`metrics.observe_times`), so its `_sum / _count` is the mean over tokens, as
Dynamo's per-token observations give. The in-flight count is a plain int per model,
set on its gauge when /metrics is read (`refresh`): a gauge's `set` takes a lock.

It counts; it decides nothing, and it must not raise into a request's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo_ftctl.clock import Clock
    from dynamo_ftctl.proxy.ledger import Endpoint

__all__ = ["UNKNOWN_MODEL", "RequestTally", "TallyBook", "error_type_of"]

# Dynamo's frontend labels a request for a model it does not serve so (and so bounds
# the label's values against clients that send anything).
UNKNOWN_MODEL = "unknown_model"
# Dynamo's `endpoint` label values for the two routes the proxy serves.
_ENDPOINT_LABEL: dict[str, str] = {"completions": "completions", "chat": "chat_completions"}
# Dynamo's `error_type` values by the HTTP status the client got.
_ERROR_TYPES: dict[int, str] = {400: "validation", 404: "not_found", 422: "validation",
                                429: "overload", 529: "overload", 501: "not_implemented",
                                503: "unavailable", 504: "response_timeout"}


def error_type_of(status: int) -> str:
    """Dynamo's `error_type` for an answer of HTTP `status` ("" for a success)."""
    if status < 400:
        return ""
    return _ERROR_TYPES.get(status, "internal")


class TallyBook:
    """The proxy process's request series: cached label children and in-flight counts."""

    def __init__(self, metrics: Any, clock: Clock) -> None:
        self.metrics = metrics  # dynamo_ftctl.metrics, loaded by the fleet
        self.clock = clock
        self.inflight: dict[str, int] = {}
        self._counters: dict[tuple[str, str, str, str, str], Any] = {}
        self._per_model: dict[str, tuple[Any, Any, Any]] = {}

    def start(self, endpoint: Endpoint) -> RequestTally:
        """A request that came in now (its model and kind are known later, or never)."""
        return RequestTally(self, _ENDPOINT_LABEL[endpoint], self.clock.now())

    def histograms(self, model: str) -> tuple[Any, Any, Any]:
        """(duration, TTFT, ITL) children of `model`."""
        found = self._per_model.get(model)
        if found is None:
            m = self.metrics
            found = (m.DYNAMO_REQUEST_DURATION.labels(model), m.DYNAMO_TTFT.labels(model),
                     m.DYNAMO_ITL.labels(model))
            self._per_model[model] = found
        return found

    def count(self, labels: tuple[str, str, str, str, str]) -> None:
        """One request ended: `dynamo_frontend_requests_total` by (model, endpoint,
        request_type, status, error_type), its child cached."""
        counter = self._counters.get(labels)
        if counter is None:
            counter = self._counters[labels] = self.metrics.DYNAMO_REQUESTS.labels(*labels)
        counter.inc()

    def refresh(self) -> None:
        """Set the in-flight gauge of every model seen (each read of /metrics does)."""
        for model, count in self.inflight.items():
            self.metrics.DYNAMO_INFLIGHT.labels(model).set(count)


class RequestTally:
    """One request's figures until it ends; `finish` counts them, once."""

    __slots__ = ("admitted", "book", "done", "endpoint", "first", "model", "started",
                 "streamed")

    def __init__(self, book: TallyBook, endpoint: str, started: float) -> None:
        self.book = book
        self.endpoint = endpoint
        self.started = started
        self.model = UNKNOWN_MODEL
        self.streamed = False
        self.admitted = False
        self.first: float | None = None
        self.done = False

    def admit(self, model: str, *, streamed: bool) -> None:
        """The request is served (in flight) for `model` from now on."""
        self.model = model
        self.streamed = streamed
        self.admitted = True
        inflight = self.book.inflight
        inflight[model] = inflight.get(model, 0) + 1

    def first_token(self) -> None:
        """The first batch of tokens reached the proxy (later calls do nothing)."""
        if self.first is None:
            self.first = self.book.clock.now()
            self.book.histograms(self.model)[1].observe(self.first - self.started)

    def finish(self, error_type: str, tokens: int = 0) -> None:
        """The request ended: "" for a success, else Dynamo's `error_type`; `tokens` is
        how many it generated. Only the first call counts."""
        if self.done:
            return
        self.done = True
        book = self.book
        end = book.clock.now()
        duration, _, itl = book.histograms(self.model)
        duration.observe(end - self.started)
        if not error_type and self.first is not None and tokens > 1:
            from dynamo_ftctl.metrics import observe_times

            observe_times(itl, (end - self.first) / (tokens - 1), tokens - 1)
        book.count((self.model, self.endpoint, "stream" if self.streamed else "unary",
                    "error" if error_type else "success", error_type))
        if self.admitted:
            book.inflight[self.model] -= 1
