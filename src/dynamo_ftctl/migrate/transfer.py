"""Move one in-flight request between workers: by KV transfer or by re-prefill.

Both methods start the same way: the source's admin API exports the request
(`GET /admin/kv/{id}?abort=true`, the `kv.wire` format), which stops it there
and hands over its token ids, sampling state and KV blocks. Then either

- **kv**: the export is posted to the target's `POST /admin/kv/import`, which
  copies the blocks into its cache and continues decoding at once; or
- **reprefill**: the target gets an ordinary `/v1/completions` request whose
  prompt is every token so far, with the remaining `max_tokens` and the same
  seed; it recomputes the cache and continues.

Sampling keyed by (seed, position) makes both continue identically. With
`method="auto"` a calibration (`migrate/calibrate.py`) decides through the
cost model. The proxy calls `migrate_request` with its own client; the CLI
calls `migrate_request_sync`.

Engines without the admin KV API (vLLM, SGLang: only `ftctl sim` has it): a
target that has no import route (404, 405 or 501, or no admin URL) gets the
request by re-prefill instead, and the result says so (`fallback`); a source
with no export route cannot hand the request's state over at all, which is
`KvApiMissing` (exit 2): there the proxy, which saw every token it streamed,
is what moves requests.

HTTP goes through one injected `dynamo_ftctl.http1.Client`; its errors become
`Unreachable` (no answer) or `InvalidInput` (refused), in one line naming the
worker.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import FtctlError, InvalidInput, Unreachable
from dynamo_ftctl.http1.response import DEFAULT_LIMIT
from dynamo_ftctl.jsoncodec import loads

if TYPE_CHECKING:
    from rich.console import Group

    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.inventory import Inventory
    from dynamo_ftctl.kv.wire import KvHeader
    from dynamo_ftctl.migrate.calibrate import Calibration
    from dynamo_ftctl.migrate.cost import MigrationPlan

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EXPORT_LIMIT",
    "Continuation",
    "Endpoint",
    "KvApiMissing",
    "MigrationResult",
    "RequestState",
    "endpoint_for",
    "export_request",
    "fetch",
    "http_errors",
    "migrate_request",
    "migrate_request_sync",
    "refusal",
    "reprefill_body",
    "resume_by_kv",
    "resume_by_reprefill",
    "stream_completion",
]

Method = Literal["kv", "reprefill"]
METHODS = ("auto", "kv", "reprefill")
# How a server says it has no such route: its router's 404, or 405 / 501.
_NO_ROUTE = (404, 405, 501)
# Per connection, header wait and read, unless the caller says otherwise (the CLI's default).
DEFAULT_TIMEOUT_S = 60.0
# http1's 10 MiB default would refuse a long context's export; the worker's cache bounds it.
EXPORT_LIMIT = 1 << 40


class KvApiMissing(InvalidInput):
    """A worker has no admin KV route (export or import): its router answered for it."""


@dataclass(frozen=True)
class Endpoint:
    """Where to reach one worker: its OpenAI URL, admin URL and bearer token."""

    name: str
    url: str
    admin_url: str
    token: str | None = field(default=None, repr=False)
    group: str | None = None  # TP/PP group (metric labels); the name when None

    def admin_headers(self) -> dict[str, str]:
        """The Authorization header of the admin API (empty without a token)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def endpoint_for(inventory: Inventory, name: str) -> Endpoint:
    """The endpoint of inventory worker `name`; the token comes from its `token_env`."""
    worker = inventory.worker(name)
    env = worker.admin.token_env if worker.admin else "FTCTL_ADMIN_TOKEN"
    return Endpoint(name=worker.name, url=str(worker.url).rstrip("/"),
                    admin_url=str(worker.admin_url).rstrip("/"), token=os.environ.get(env),
                    group=inventory.group_of(worker))


@dataclass(frozen=True)
class RequestState:
    """What an export says about a request: its tokens, sampling and KV geometry."""

    request_id: str
    model: str
    token_ids: tuple[int, ...]
    prompt_len: int
    num_cached: int
    sampling: Mapping[str, Any]
    kv_bytes_per_token: int
    payload_bytes: int

    @property
    def generated(self) -> tuple[int, ...]:
        """Tokens generated on the source before the move."""
        return self.token_ids[self.prompt_len:]

    @property
    def remaining(self) -> int:
        """Tokens still to generate."""
        return int(self.sampling.get("max_tokens", 0)) - len(self.generated)


@dataclass(frozen=True)
class Continuation:
    """What the target generated after the move."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    first_token_s: float  # from sending the request to the first new token
    total_s: float


@dataclass(frozen=True)
class MigrationResult:
    """One request moved: how, how long each step took, and what came out."""

    request_id: str
    source: str
    target: str
    requested: str
    method: Method
    context_tokens: int
    payload_bytes: int
    export_s: float
    move_s: float  # kv: export + import to first token; reprefill: prefill to first token
    generated_before: tuple[int, ...]
    continuation: tuple[int, ...]
    text: str
    finish_reason: str | None
    plan: MigrationPlan | None = None
    fallback: str | None = None  # why `method` is not what was asked (no KV import API)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """Every generated token: before the move on the source, then on the target."""
        return self.generated_before + self.continuation

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (the plan included when auto decided)."""
        from dataclasses import fields

        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        doc["output_token_ids"] = self.output_token_ids
        doc["plan"] = self.plan.to_json() if self.plan else None
        return doc

    def __rich__(self) -> Group:
        from rich.console import Group

        from dynamo_ftctl.output import kv_table

        rows = {
            "request": self.request_id,
            "moved": f"{self.source} → {self.target} by {self.method}"
                     f"{' (auto)' if self.requested == 'auto' else ''}",
            **({"fallback": self.fallback} if self.fallback else {}),
            "context": f"{self.context_tokens} tokens, {self.payload_bytes} bytes exported",
            "export": f"{self.export_s * 1e3:.2f} ms",
            "move": f"{self.move_s * 1e3:.2f} ms to the first new token",
            "tokens": f"{len(self.generated_before)} before, {len(self.continuation)} after, "
                      f"finish {self.finish_reason}",
        }
        return Group(kv_table("migration", rows), self.text)


def _state_from_header(header: KvHeader, payload_bytes: int) -> RequestState:
    lay = header.layout
    return RequestState(
        request_id=header.request_id, model=header.model, token_ids=tuple(header.token_ids),
        prompt_len=header.prompt_len, num_cached=header.num_tokens,
        sampling=dict(header.sampling),
        kv_bytes_per_token=lay.block_bytes // lay.block_size, payload_bytes=payload_bytes,
    )


@asynccontextmanager
async def http_errors(what: str, endpoint: Endpoint) -> AsyncIterator[None]:
    """Translate http1's failures inside the block into one-line `Unreachable`s."""
    from dynamo_ftctl.http1 import HttpError

    try:
        yield
    except TimeoutError as exc:
        msg = f"{endpoint.name}: {what} timed out ({exc.__class__.__name__})"
        raise Unreachable(msg) from None
    except HttpError as exc:
        msg = f"{endpoint.name}: {what} failed: {exc.__class__.__name__}: {exc}"
        raise Unreachable(msg) from None


async def fetch(client: Client, method: str, url: str, body: bytes = b"",
                headers: dict[str, str] | None = None, *, timeout_s: float,
                limit: int = DEFAULT_LIMIT) -> tuple[int, bytes]:
    """One exchange, (status, body): `timeout_s` for the connection, the headers and each read.

    Not `Client.fetch` (one deadline for everything): a large KV export may take
    longer than `timeout_s` in all while its bytes keep coming.
    """
    response = await client.request(method, url, body, headers, connect_timeout_s=timeout_s,
                                    head_timeout_s=timeout_s)
    async with response:
        assert response.status is not None  # set before the headers are complete
        return response.status, await response.read(limit, timeout_s)


def _detail(body: bytes) -> str:
    """The OpenAI error message of an answer's body, or the body as text."""
    text = body.decode("utf-8", "replace")
    try:
        doc = loads(body)
    except ValueError:
        return text
    error = doc.get("error") if isinstance(doc, dict) else None
    return str(error.get("message", text)) if isinstance(error, dict) else text


def refusal(endpoint: Endpoint, what: str, status: int, body: bytes) -> FtctlError:
    """A worker's non-2xx answer: `Unreachable` for 5xx, `InvalidInput` otherwise."""
    msg = f"{endpoint.name}: {what} refused ({status}): {_detail(body)[:200]}"
    if status >= 500:
        return Unreachable(msg)
    return InvalidInput(msg)


def _route_missing(status: int, body: bytes) -> bool:
    """Whether an answer is a router's "no such route" rather than the admin API's answer.

    The sim's export answers an unknown request id with 404 and `error.type`
    NotFoundError; vLLM's router answers a missing route with 404 and type "Not Found".
    """
    if status != 404:
        return status in _NO_ROUTE
    try:
        doc = loads(body)
    except ValueError:
        return True
    error = doc.get("error") if isinstance(doc, dict) else None
    return not (isinstance(error, dict) and error.get("type") == "NotFoundError")


def _no_export_api(source: Endpoint, request_id: str, status: int) -> KvApiMissing:
    return KvApiMissing(
        f"{source.name}: the state of request {request_id!r} cannot be read from this worker: "
        f"it has no KV export API (GET /admin/kv/{{id}} answered HTTP {status}); on engines "
        "without one (vLLM, SGLang) `ftctl proxy` migrates requests, by re-prefill of the "
        "tokens it streamed")


def _import_refusal(target: Endpoint, what: str, status: int, body: bytes) -> FtctlError:
    if status in _NO_ROUTE:  # the import route never answers these itself
        return KvApiMissing(f"{target.name}: no KV import API (POST /admin/kv/import "
                            f"answered HTTP {status})")
    return refusal(target, what, status, body)


async def export_request(
    client: Client, source: Endpoint, request_id: str, *,
    abort: bool = True, clock: Clock = SYSTEM_CLOCK, timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[RequestState, bytes, float]:
    """Export `request_id` from `source` (stopping it there when `abort`).

    Returns the decoded state, the raw payload and the seconds the export took;
    `KvApiMissing` when the source has no export route (vLLM).
    """
    from dynamo_ftctl.kv.wire import decode_kv

    url = f"{source.admin_url}/admin/kv/{request_id}{'?abort=true' if abort else ''}"
    start = clock.now()
    async with http_errors("KV export", source):
        status, payload = await fetch(client, "GET", url, headers=source.admin_headers(),
                                      timeout_s=timeout_s, limit=EXPORT_LIMIT)
    elapsed = clock.now() - start
    if status != 200:
        if _route_missing(status, payload):
            raise _no_export_api(source, request_id, status)
        raise refusal(source, f"KV export of {request_id!r}", status, payload)
    decoded = decode_kv(payload)
    return _state_from_header(decoded.header, len(payload)), payload, elapsed


async def stream_completion(
    client: Client, endpoint: Endpoint, what: str, method: str, url: str, *,
    clock: Clock, first_only: bool = False,
    refuse: Callable[[Endpoint, str, int, bytes], FtctlError] = refusal,
    body: bytes = b"", headers: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Continuation:
    """POST/GET a streaming completion and collect it (up to the first token if `first_only`).

    A status other than 200 raises `refuse(endpoint, what, status, body)`;
    `timeout_s` bounds the connection, the headers and each wait for bytes.
    """
    from dynamo_ftctl.openai import SseDecoder, StreamAccumulator, parse_sse_event

    acc = StreamAccumulator()
    first: float | None = None
    start = clock.now()
    async with http_errors(what, endpoint):
        response = await client.request(method, url, body, headers,
                                        connect_timeout_s=timeout_s, head_timeout_s=timeout_s)
        async with response:
            if response.status != 200:
                answer = await response.read(timeout_s=timeout_s)
                raise refuse(endpoint, what, response.status or 0, answer)
            decoder = SseDecoder()
            while chunk := await response.next_chunk(timeout_s):
                for event in decoder.feed(chunk):
                    parsed = parse_sse_event(event)
                    if parsed is not None and parsed.token_ids and first is None:
                        first = clock.now() - start
                    acc.add(parsed)
                if acc.done or (first_only and first is not None):
                    break
    total = clock.now() - start
    return Continuation(
        token_ids=tuple(acc.token_ids), text=acc.text, finish_reason=acc.finish_reason,
        first_token_s=total if first is None else first, total_s=total,
    )


async def resume_by_kv(
    client: Client, target: Endpoint, payload: bytes, request_id: str,
    *, clock: Clock = SYSTEM_CLOCK, timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Continuation:
    """Import an export on `target` and collect the continuation it streams.

    `KvApiMissing` when the target has no import route (or no admin URL).
    """
    if not target.admin_url:
        msg = f"{target.name}: no KV import API (no admin URL)"
        raise KvApiMissing(msg)
    return await stream_completion(
        client, target, "KV import", "POST", f"{target.admin_url}/admin/kv/import", clock=clock,
        refuse=_import_refusal, body=payload, timeout_s=timeout_s,
        headers={**target.admin_headers(), "X-Request-Id": request_id,
                 "Content-Type": "application/octet-stream"},
    )


def reprefill_body(state: RequestState) -> dict[str, Any]:
    """The `/v1/completions` body that recomputes the cache and continues the request."""
    from dynamo_ftctl.openai import completion_request

    s = state.sampling
    extra: dict[str, Any] = {"ignore_eos": bool(s.get("ignore_eos", False))}
    if s.get("top_k"):
        extra["top_k"] = int(s["top_k"])
    if s.get("stop_token_ids"):
        extra["stop_token_ids"] = [int(t) for t in s["stop_token_ids"]]
    return completion_request(
        state.model, list(state.token_ids), max_tokens=state.remaining,
        temperature=float(s.get("temperature", 0.0)), top_p=float(s.get("top_p", 1.0)),
        seed=int(s["seed"]), stream=True, return_token_ids=True, extra=extra,
    )


async def resume_by_reprefill(
    client: Client, target: Endpoint, state: RequestState, request_id: str,
    *, clock: Clock = SYSTEM_CLOCK, timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Continuation:
    """Re-prefill every token so far on `target` and collect the continuation."""
    return await stream_completion(
        client, target, "re-prefill", "POST", f"{target.url}/v1/completions", clock=clock,
        body=json.dumps(reprefill_body(state)).encode(), timeout_s=timeout_s,
        headers={"X-Request-Id": request_id, "Content-Type": "application/json"},
    )


def choose_method(state: RequestState, calibration: Calibration) -> MigrationPlan:
    """The cost model's plan for this request under measured rates."""
    from dynamo_ftctl.migrate.cost import plan_migration

    return plan_migration(
        calibration.model_preset(), tp=1,
        tokens=len(state.token_ids), link=calibration.link(), block_size=1,
        prefill=calibration.prefill_model(), prefill_source="calibrated",
    )


async def migrate_request(
    client: Client,
    source: Endpoint,
    target: Endpoint,
    request_id: str,
    *,
    method: str = "auto",
    calibration: Calibration | None = None,
    clock: Clock = SYSTEM_CLOCK,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> MigrationResult:
    """Stop `request_id` on `source` and continue it on `target` by KV transfer or re-prefill.

    `timeout_s` bounds each connection, wait for headers and wait for bytes.
    """
    if method not in METHODS:
        msg = f"--method must be one of {', '.join(METHODS)} (got {method!r})"
        raise InvalidInput(msg)
    if method == "auto" and calibration is None:
        msg = "--method auto needs a calibration file (ftctl migrate calibrate)"
        raise InvalidInput(msg)
    if source.name == target.name:
        msg = f"source and target are the same worker ({source.name})"
        raise InvalidInput(msg)
    state, payload, export_s = await export_request(client, source, request_id, clock=clock,
                                                    timeout_s=timeout_s)
    if state.remaining <= 0:
        msg = f"request {request_id!r} has nothing left to generate"
        raise InvalidInput(msg)
    plan = None
    chosen: Method
    if method == "auto":
        assert calibration is not None
        plan = choose_method(state, calibration)
        chosen = plan.decision
    else:
        chosen = "kv" if method == "kv" else "reprefill"
    fallback = None
    if chosen == "kv":
        tried = clock.now()
        try:
            cont = await resume_by_kv(client, target, payload, request_id, clock=clock,
                                      timeout_s=timeout_s)
            move_s = export_s + cont.first_token_s
        except KvApiMissing as exc:  # a vLLM target: recompute the cache there instead
            fallback = f"{exc}: re-prefilled instead of kv"
            chosen = "reprefill"
            failed_s = clock.now() - tried
            cont = await resume_by_reprefill(client, target, state, request_id, clock=clock,
                                             timeout_s=timeout_s)
            move_s = failed_s + cont.first_token_s
    else:
        cont = await resume_by_reprefill(client, target, state, request_id, clock=clock,
                                         timeout_s=timeout_s)
        move_s = cont.first_token_s
    from dynamo_ftctl import metrics

    metrics.MIGRATION_TOTAL.labels(source.group or source.name, target.group or target.name,
                                   chosen).inc()
    metrics.MIGRATION_DURATION.observe(move_s)
    return MigrationResult(
        request_id=request_id, source=source.name, target=target.name, requested=method,
        method=chosen, context_tokens=len(state.token_ids), payload_bytes=state.payload_bytes,
        export_s=export_s, move_s=move_s, generated_before=state.generated,
        continuation=cont.token_ids, text=cont.text, finish_reason=cont.finish_reason, plan=plan,
        fallback=fallback,
    )


def migrate_request_sync(
    inventory: Inventory,
    *,
    request_id: str,
    source: str,
    target: str,
    method: str = "auto",
    calibration: Calibration | None = None,
    timeout_s: float = 60.0,
) -> MigrationResult:
    """`migrate_request` for inventory workers, with its own HTTP client (the CLI's entry)."""
    import asyncio

    from dynamo_ftctl.http1 import Client

    cal = calibration
    src, dst = endpoint_for(inventory, source), endpoint_for(inventory, target)

    async def run() -> MigrationResult:
        client = Client()
        try:
            return await migrate_request(client, src, dst, request_id, method=method,
                                         calibration=cal, timeout_s=timeout_s)
        finally:
            await client.close()

    return asyncio.run(run())
