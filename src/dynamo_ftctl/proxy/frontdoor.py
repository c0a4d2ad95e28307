"""The front door: the proxy's `httpserver` handler, where a client's request comes in.

A generation (POST /v1/completions, /v1/chat/completions) is parsed and checked
(`continuation.prepare_request`), admitted or shed (`admission.decide`: 503/529
with Retry-After when every worker is busy or the degradation level sheds its
priority tier), handed to the migration policy (`MigrationPolicy.answer` for a whole
answer, `streams.stream_generate` for a stream), and
its chunks answered: streamed as SSE once the first batch is in hand (so the
headers can name the serving worker), or collected into one JSON answer. Every
upstream request is streamed with token ids, even when the client asked for one
JSON answer, so that a generation broken half-way can go on elsewhere.

The other routes, on `httpapp.Router`: GET /v1/models, /health, /metrics; GET/POST
/busy_threshold (POST needs the admin bearer token, `proxy.admin_token_env`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from dynamo_ftctl.auth import check_bearer, token_from_env
from dynamo_ftctl.httpapp import Router, json_reply, metrics_reply, request_json
from dynamo_ftctl.httpserver import Reply, Stream
from dynamo_ftctl.openai import error_body, parse_request_json
from dynamo_ftctl.proxy.admission import BUSY_BODY, Thresholds, decide, parse_priority
from dynamo_ftctl.proxy.attempt import Lane
from dynamo_ftctl.proxy.codec import dumps
from dynamo_ftctl.proxy.continuation import RequestRejected, prepare_request
from dynamo_ftctl.proxy.counting import weakest
from dynamo_ftctl.proxy.ledger import StreamLedger
from dynamo_ftctl.proxy.policy import ProxyError, StreamAborted
from dynamo_ftctl.proxy.streams import COUNT_HEADER, MIGRATED_HEADER, sse_body, stream_generate
from dynamo_ftctl.proxy.tally import UNKNOWN_MODEL, TallyBook, error_type_of

if TYPE_CHECKING:
    from dynamo_ftctl.httpserver import Request, Server
    from dynamo_ftctl.inventory.proxy import ProxyConfig
    from dynamo_ftctl.proxy.fleet import Fleet
    from dynamo_ftctl.proxy.ledger import Endpoint
    from dynamo_ftctl.proxy.policy import MigrationPolicy
    from dynamo_ftctl.proxy.tally import RequestTally

__all__ = ["CONTINUATION_HEADER", "COUNT_HEADER", "MIGRATED_HEADER", "PRIORITY_HEADER",
           "TIMING_HEADER", "WORKER_HEADER", "FrontDoor"]

log = logging.getLogger("ftctl.proxy")

# What a request's body becomes in the proxy, per byte of it, on top of the raw bytes
# the server counts: the parsed JSON, the ledger's prompt ids and the upstream body.
# Measured at 7.1 for a 14 MiB token-id prompt (an int object and two list slots per id)
# and 2.5 for a text prompt (tracemalloc over parse, prepare, ledger and encode).
PARSED_BYTES_PER_BYTE = 7
# MIGRATED_HEADER and COUNT_HEADER are streams.py's (the SSE body's end says them too).
CONTINUATION_HEADER = "x-ftctl-continuation"
WORKER_HEADER = "x-ftctl-worker"
# The `X-Request-Id` the serving worker got for this answer (each attempt has its own):
# what its logs and its KV export name the request by.
UPSTREAM_ID_HEADER = "x-ftctl-upstream-id"
# The serving worker's time to first token as the proxy saw it (W3C Server-Timing).
TIMING_HEADER = "Server-Timing"
PRIORITY_HEADER = "x-ftctl-priority"

_GENERATION_ROUTES: dict[str, Endpoint] = {
    "/v1/completions": "completions", "/v1/chat/completions": "chat",
}
_PRIORITY_KEY = PRIORITY_HEADER.encode()
_REQUEST_ID_KEY = b"x-request-id"


def _reply(status: int, doc: Any, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, dumps(doc), headers=headers or {})


def _failed_reply(exc: ProxyError | StreamAborted) -> Reply:
    """The client's answer to a request that failed before its answer began: the policy's
    HTTP error, or a 502 of the abort's kind."""
    if isinstance(exc, ProxyError):
        return _reply(exc.status, exc.body, exc.headers)
    return _reply(502, error_body(str(exc), type=exc.kind, code=502))


class FrontDoor:
    """The handler `httpserver.start_server` runs: generations first, then the other routes."""

    def __init__(self, fleet: Fleet, policy: MigrationPolicy, config: ProxyConfig) -> None:
        self.fleet = fleet
        self.policy = policy
        self.config = config
        self.tally = TallyBook(fleet.metrics, fleet.clock)  # Dynamo's request series
        # The server's budget of buffered request bytes (`serve` sets it): a request's
        # parsed form is counted in it too, not only its raw bytes.
        self.budget: Server | None = None
        self.routes = Router()
        self.routes.get("/v1/models", self._models)
        self.routes.get("/health", self._health)
        self.routes.get("/metrics", self._metrics)
        self.routes.get("/busy_threshold", self._busy_threshold)
        self.routes.post("/busy_threshold", self._busy_threshold)

    async def __call__(self, request: Request) -> Reply | Stream:
        # The generation routes skip the router: they are the hot path.
        endpoint = _GENERATION_ROUTES.get(request.path) if request.method == "POST" else None
        if endpoint is None:
            return await self.routes(request)
        priority = request.header(_PRIORITY_KEY)
        request_id = request.header(_REQUEST_ID_KEY)
        return await self.generation(
            endpoint, request.body, None if priority is None else priority.decode("latin-1"),
            None if request_id is None else request_id.decode("latin-1"))

    # ------------------------------------------------------------------ generations

    async def generation(self, endpoint: Endpoint, raw_body: bytes, priority: str | None,
                         request_id: str | None = None) -> Reply | Stream:
        """POST /v1/completions and /v1/chat/completions (`priority`: the tier header).

        `request_id` is the client's `X-Request-Id`: every worker gets it, and so does
        the client back; without one the proxy makes a UUID (some servers refuse other
        ids with 400). A `Stream` has its first batch in hand (the worker answered); a
        non-streamed answer is collected while the client waits (the server cancels
        this handler, and so the upstream request, when the client leaves).
        """
        tally = self.tally.start(endpoint)
        held = len(raw_body) * PARSED_BYTES_PER_BYTE if self.budget is not None else 0
        if held and self.budget is not None and not self.budget.hold(held):
            tally.finish("overload")
            return _reply(503, error_body(
                "this proxy holds as many request bytes as max_buffered_mib allows; retry "
                "later", type="service_unavailable", code=503),
                {"Retry-After": str(self.config.retry_after_s)})
        handed_on = False  # a streamed answer gives the bytes back (and counts) when it ends
        try:
            reply = await self._generate(endpoint, raw_body, priority, request_id,
                                         lambda: self._release(held), tally=tally)
            handed_on = isinstance(reply, Stream)
            if not handed_on:
                tally.finish(error_type_of(reply.status))
            return reply
        finally:
            if not handed_on:
                self._release(held)
                tally.finish("cancelled")  # the client left (or a bug): counted once

    def _release(self, held: int) -> None:
        if held and self.budget is not None:
            self.budget.release(held)

    async def _generate(self, endpoint: Endpoint, raw_body: bytes, priority: str | None,
                        request_id: str | None, release: Callable[[], None], *,
                        tally: RequestTally) -> Reply | Stream:
        try:
            raw = parse_request_json(raw_body)
            body = prepare_request(endpoint, raw)
        except (ValueError, RequestRejected) as exc:
            param = exc.param if isinstance(exc, RequestRejected) else None
            return _reply(400, error_body(f"invalid request: {exc}",
                                          type="invalid_request_error", param=param, code=400))
        model = body.get("model")
        if model is not None and (not isinstance(model, str)
                                  or not self.fleet.balancer.serves(model)):
            return _reply(404, error_body(f"The model {model!r} does not exist.",
                                          type="NotFoundError", code=404))
        if isinstance(model, str):
            tally.model = model
        tally.streamed = body.get("stream") is True
        try:
            self.admit(model, priority)
        except ProxyError as exc:
            return _reply(exc.status, exc.body, exc.headers)
        ledger = StreamLedger(endpoint=endpoint, body=body,
                              migration_limit=self.config.migration_limit,
                              trace_id=request_id or "")
        lane = Lane() if ledger.client_streams else None
        whole_max = self.config.whole_max_tokens  # 0: off, whatever max_tokens says
        if lane is None and whole_max and ledger.max_tokens is not None \
                and ledger.max_tokens <= whole_max:
            ledger.whole = True
        tally.admit(model if isinstance(model, str) else UNKNOWN_MODEL, streamed=lane is not None)
        if ledger.whole:
            try:
                await self.policy.answer(ledger)
            except (ProxyError, StreamAborted) as exc:
                return _failed_reply(exc)
            # No first token nor gaps between tokens are seen in a whole answer: its
            # request counts in the duration and the request counter only.
            tally.finish("", ledger.generated_count)
            return Reply(200, dumps(ledger.response()), headers=_answer_headers(ledger))
        chunks = stream_generate(self.policy, ledger, lane)
        if lane is None:
            # The generator is closed after the block, not in a finally: compiled (mypyc),
            # an await while an exception is handled leaks it to the other tasks.
            failed: Reply | BaseException | None = None
            try:
                async for _ in chunks:
                    if tally.first is None:
                        tally.first_token()
            except (ProxyError, StreamAborted) as exc:
                failed = _failed_reply(exc)
            except BaseException as exc:  # the client left (or a bug): closed, then raised
                failed = exc
            await chunks.aclose()
            if isinstance(failed, BaseException):
                raise failed
            if failed is not None:
                return failed
            tally.finish("", ledger.generated_count)
            return Reply(200, dumps(ledger.response()), headers=_answer_headers(ledger))
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except (ProxyError, StreamAborted) as exc:
            return _failed_reply(exc)
        tally.first_token()
        return Stream(sse_body(ledger, first, chunks, release, tally),
                      headers=_answer_headers(ledger), on_push=lane.bind)

    def admit(self, model: str | None, priority_header: str | None) -> None:
        """Raise `ProxyError` (503/529 + Retry-After) when the request must be refused."""
        priority = parse_priority(priority_header)
        level = self.fleet.level()
        decision = decide(priority, level, self.fleet.busy_flags(model),
                          premium_when_busy=self.config.premium_when_busy == "admit")
        if decision.admitted:
            return
        self.fleet.metrics.TASKS_REJECTED.labels(decision.reason, priority).inc()
        status: int = self.config.reject_status
        if decision.reason == "all_workers_busy":
            body = dict(BUSY_BODY)
        elif decision.reason == "no_healthy_worker":
            body = {**BUSY_BODY, "message": "Service temporarily unavailable: "
                    "no healthy worker, please retry later"}
        else:
            body = {**BUSY_BODY, "message": f"Service temporarily unavailable: {priority} "
                    f"requests are shed at degradation level {level}, please retry later"}
        retry_after = self.config.retry_after_s
        full = self.fleet.full_answer(model)
        if full is not None and not decision.reason.startswith("degradation_level"):
            # Workers spared by backpressure: the client hears their status and wait.
            status, retry_after = full[0], max(retry_after, full[1])
            body["message"] = ("Service temporarily unavailable: every worker is full, "
                               f"please retry after {retry_after} s")
        body["code"] = status
        raise ProxyError(status, body, {"Retry-After": str(retry_after)})

    # ------------------------------------------------------------------ other routes

    async def _models(self, _: Request) -> Reply:
        return json_reply(self.fleet.models())

    async def _health(self, _: Request) -> Reply:
        return json_reply(self.fleet.health())

    async def _metrics(self, _: Request) -> Reply:
        self.fleet.refresh_busy()
        self.fleet.refresh_gauges()
        self.tally.refresh()
        return metrics_reply(self.fleet.metrics.registry_for(self.fleet.metrics.PROXY))

    async def _busy_threshold(self, request: Request) -> Reply:
        """GET (anyone) or POST (admin token) the busy thresholds of a model."""
        thresholds = self.fleet.thresholds
        if request.method != "POST":
            model = dict(parse_qsl(request.query)).get("model")
            if model is not None:
                if model not in thresholds:
                    return _not_found(model)
                return json_reply(self.fleet.busy_threshold_doc(model))
            return json_reply({"thresholds": [self.fleet.busy_threshold_doc(m)
                                              for m in thresholds]})
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        try:
            doc = request_json(request)
            if not isinstance(doc, dict):
                msg = "expected a JSON object"
                raise ValueError(msg)
            model = doc.get("model", next(iter(thresholds)))
            if model not in thresholds:
                return _not_found(model)
            current = thresholds[model]
            unknown = set(doc) - {"model", "active_decode_blocks_threshold",
                                  "active_prefill_tokens_threshold"}
            if unknown:
                msg = f"unknown keys {sorted(unknown)}"
                raise ValueError(msg)
            thresholds[model] = Thresholds(
                active_decode_blocks_threshold=doc.get(
                    "active_decode_blocks_threshold", current.active_decode_blocks_threshold),
                active_prefill_tokens_threshold=doc.get(
                    "active_prefill_tokens_threshold", current.active_prefill_tokens_threshold),
            )
        except ValueError as exc:
            return json_reply(error_body(str(exc), type="invalid_request_error", code=400), 400)
        log.info("busy thresholds of %s now %s", model, thresholds[model])
        return json_reply(self.fleet.busy_threshold_doc(model))

    def _check_admin(self, request: Request) -> Reply | None:
        env = self.config.admin_token_env
        authorization = request.header(b"authorization")
        denied = check_bearer(None if authorization is None else authorization.decode("latin-1"),
                              token_from_env(env),
                              unset=f"admin API disabled: ${env} is not set")
        if denied is None:
            return None
        kind = "forbidden" if denied.status == 403 else "unauthorized"
        return json_reply(error_body(denied.message, type=kind, code=denied.status),
                          denied.status, denied.headers)


def _not_found(model: Any) -> Reply:
    return json_reply(error_body(f"unknown model {model!r}", type="not_found", code=404), 404)


def _count_source(ledger: StreamLedger) -> str:
    """The `x-ftctl-count` of the answer so far: a text attempt still streaming will be
    settled by its usage chunk, which every upstream request asks for."""
    if not ledger.count_unsettled:
        return ledger.count_source
    return weakest([*ledger.count_sources, "usage"])


def _answer_headers(ledger: StreamLedger) -> dict[str, str]:
    headers = {"Cache-Control": "no-cache", "X-Request-Id": ledger.trace_id,
               WORKER_HEADER: ",".join(ledger.workers), UPSTREAM_ID_HEADER: ledger.upstream_id}
    if ledger.migrations:
        headers[MIGRATED_HEADER] = str(ledger.migrations)
    if not ledger.exact:
        headers[CONTINUATION_HEADER] = "text"
    ledger.count_header = headers[COUNT_HEADER] = _count_source(ledger)
    if ledger.upstream_ttft_s is not None:
        ms = ledger.upstream_ttft_s * 1e3
        headers[TIMING_HEADER] = f'upstream;desc="first token";dur={ms:.3f}'
    return headers
