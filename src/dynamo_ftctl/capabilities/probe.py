"""Probing one worker: what it supports (`Capabilities`), found by asking it.

It must not: raise for a missing feature (a probe that fails leaves its field
None, "unknown"); change a worker's state (the KV probe asks for a request id
that cannot exist and never aborts; nothing is posted to /sleep or /admin/fault;
the generation probes ask for one greedy token); read an unbounded body or wait
without a deadline (each probe has `timeout_s`, the worker as a whole a little
more, and each exchange reads at most `MAX_PROBE_BYTES`).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.capabilities.fetch import MAX_PROBE_BYTES, probe_client
from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.http1.transport import Request
from dynamo_ftctl.jsoncodec import dumps, loads
from dynamo_ftctl.sse import iter_sse_events

if TYPE_CHECKING:
    from dynamo_ftctl.http1.transport import AsyncTransport
    from dynamo_ftctl.inventory import Worker

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "KV_USAGE_METRICS",
    "PROBE_PROMPT",
    "Capabilities",
    "LoadMetric",
    "admin_token_of",
    "known_good_failure",
    "known_good_request",
    "load_metric_from_metrics",
    "probe_capabilities",
    "start_time_from_metrics",
]

# Each probe is one short exchange; a worker that needs longer to say /health is
# not one a proxy should route to yet.
DEFAULT_TIMEOUT_S = 3.0
# Past the probes' own timeout, how long the whole worker may take (a transport that
# ignores its timeout must not hang the probe).
_GRACE_S = 1.0

LoadMetric = Literal["vllm", "vllm_old", "none"]
# The KV-usage gauge each load-metric family exposes (the proxy's admission reads them).
KV_USAGE_METRICS: Mapping[LoadMetric, str] = {
    "vllm": "vllm:kv_cache_usage_perc",
    "vllm_old": "vllm:gpu_cache_usage_perc",  # vLLM before 0.10
}
_TOKEN_FIELD = "return_token_ids"  # noqa: S105 - a request field, not a secret
# The probes' prompt (named so that a test double can tell a probe from a client request).
PROBE_PROMPT = "ping"
_START_TIME = re.compile(rb"^process_start_time_seconds(?:\{[^}\n]*\})?[ \t]+(\S+)", re.MULTILINE)
_METRIC_NAME = {
    family: re.compile(rb"^" + re.escape(name.encode()) + rb"[{ \t]", re.MULTILINE)
    for family, name in KV_USAGE_METRICS.items()
}
_MISSING = (404, 405, 501)  # the route is not there (or not for this method)


@dataclass(frozen=True)
class Capabilities:
    """What one worker supports; None means unknown (the probe got no usable answer)."""

    worker: str
    url: str
    probed_at: float  # wall-clock seconds since the epoch
    error: str | None = None  # set when the worker did not answer at all
    token_ids: bool | None = None  # streamed /v1/completions returns choices[0].token_ids
    prompt_token_ids: bool | None = None  # ... and the prompt's ids
    chat_token_ids: bool | None = None  # the same on /v1/chat/completions
    strict_fields: bool | None = None  # 400/422 naming return_token_ids: unknown fields refused
    tokenize: bool | None = None  # POST /tokenize answers {"tokens": [...]}
    health: bool | None = None  # GET /health answers 200
    metrics: bool | None = None  # GET /metrics answers
    load_metric: LoadMetric | None = None  # which KV-usage gauge /metrics carries
    process_start_time: float | None = None  # process_start_time_seconds (restart signal)
    sleep: bool | None = None  # GET /is_sleeping answers (vLLM sleep mode)
    asleep: bool | None = None  # ... and what it said
    kv_export: bool | None = None  # the admin API's GET /admin/kv/{id} route exists
    max_model_len: int | None = None  # from GET /v1/models, for the worker's model
    models: tuple[str, ...] = ()  # served model ids from GET /v1/models
    server: str | None = None  # identity, informational: owned_by, /version, Server header
    notes: tuple[str, ...] = ()  # why a probe's field stayed unknown
    elapsed_s: float = 0.0

    @property
    def reachable(self) -> bool:
        """True when the worker answered at least one probe."""
        return self.error is None

    @property
    def kv_usage_metric(self) -> str | None:
        """The KV-usage gauge's name on this worker's /metrics (None: none or unknown)."""
        return KV_USAGE_METRICS.get(self.load_metric) if self.load_metric else None


@dataclass
class _Answer:
    """One exchange's outcome: a status and body, or why there is none."""

    status: int | None = None
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    failure: str | None = None


async def _exchange(transport: AsyncTransport, method: str, url: str, body: Any | None = None,
                    *, headers: Mapping[str, str] | None = None, timeout_s: float) -> _Answer:
    payload = b"" if body is None else dumps(body)
    sent = dict(headers or {})
    if body is not None:
        sent["Content-Type"] = "application/json"
    try:
        async with asyncio.timeout(timeout_s):
            reply = await transport.handle_async_request(
                Request(method, url, payload, sent, timeout_s, MAX_PROBE_BYTES))
    except TimeoutError:
        return _Answer(failure=f"no answer within {timeout_s:g} s")
    # The transport is injected: whatever it raises (OSError, a mock's own errors)
    # means "no answer" for this probe, never a crash of the probe.
    except Exception as exc:
        return _Answer(failure=str(exc) or type(exc).__name__)
    status, data, got = reply.status, reply.body, reply.headers
    if len(data) > MAX_PROBE_BYTES:  # a transport that does not bound its reads
        return _Answer(status, b"", got, failure=f"body over {MAX_PROBE_BYTES} bytes")
    return _Answer(status, data, got)


def _json(data: str | bytes) -> Any:
    """Parsed JSON, or None for garbage (bad UTF-8, bad JSON, nesting bombs)."""
    try:
        return loads(data)
    except (ValueError, RecursionError):
        return None


def _events(data: bytes) -> list[Any]:
    """The JSON documents of an SSE stream, or the one document of a plain body (a JSON
    body has no `data:` field line, so it holds no SSE event)."""
    events = [event.data for event in iter_sse_events([data])
              if event.data.strip() and not event.is_done]
    if not events:
        doc = _json(data)
        return [doc] if doc is not None else []
    return [doc for doc in map(_json, events) if doc is not None]


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _token_ids_in(data: bytes) -> tuple[bool, bool] | None:
    """(token ids seen, prompt ids seen) in a completion's chunks; None: not a completion."""
    ids = prompt = False
    completion = False
    for event in _events(data):
        if not isinstance(event, dict):
            continue
        choices = event.get("choices")
        if not isinstance(choices, list):
            continue
        completion = True
        first = choices[0] if choices and isinstance(choices[0], dict) else {}
        ids = ids or _int_list(first.get("token_ids"))
        prompt = prompt or _int_list(first.get("prompt_token_ids")) or _int_list(
            event.get("prompt_token_ids"))
    return (ids, prompt) if completion else None


def known_good_request(model: str) -> dict[str, Any]:
    """A request every healthy worker of `model` serves: one greedy token of `PROBE_PROMPT`."""
    return {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0,
            "stream": True}


def known_good_failure(status: int, body: bytes) -> str | None:
    """Why an answer to `known_good_request` is not a healthy one; None when it is.

    Healthy: HTTP 200 and a streamed completion (a chunk with `choices`), no error event.
    """
    if status != 200:
        return f"HTTP {status}"
    if _token_ids_in(body) is None:
        return "not a completion"
    if any(isinstance(e, dict) and "error" in e for e in _events(body)):
        return "an error event"
    return None


@dataclass
class _Found:
    """Fields found so far for one worker (becomes a `Capabilities`)."""

    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    answered: bool = False
    failures: list[str] = field(default_factory=list)
    server_header: str | None = None

    def saw(self, what: str, answer: _Answer) -> bool:
        """Record an exchange; True when it has a status to judge."""
        if answer.status is None or answer.failure is not None:
            if answer.status is not None:
                self.answered = True
            self.failures.append(f"{what}: {answer.failure}")
            self.notes.append(f"{what}: {answer.failure}")
            return False
        self.answered = True
        server = answer.headers.get("Server") or answer.headers.get("server")
        if server and self.server_header is None:
            self.server_header = server[:80]
        return True

    def unknown(self, what: str, answer: _Answer) -> None:
        self.notes.append(f"{what}: HTTP {answer.status}")


async def _probe_generation(found: _Found, transport: AsyncTransport, worker: Worker,
                            timeout_s: float,
                            *, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": worker.model, "max_tokens": 1, "temperature": 0,
                            "stream": True, _TOKEN_FIELD: True}
    if chat:
        body["messages"] = [{"role": "user", "content": PROBE_PROMPT}]
    else:
        body["prompt"] = PROBE_PROMPT
    answer = await _exchange(transport, "POST", f"{worker.url}{path}", body, timeout_s=timeout_s)
    what = f"POST {path}"
    if not found.saw(what, answer):
        return
    key = "chat_token_ids" if chat else "token_ids"
    if answer.status in (400, 422) and _TOKEN_FIELD.encode() in answer.body:
        # pydantic's extra="forbid" (and vLLM before the field existed, when strict)
        # answers 400/422 with the field's name in the error.
        found.values[key] = False
        found.values["strict_fields"] = True
        return
    if answer.status != 200:
        found.unknown(what, answer)
        return
    seen = _token_ids_in(answer.body)
    if seen is None:
        found.notes.append(f"{what}: not a completion")
        return
    found.values[key] = seen[0]
    found.values.setdefault("strict_fields", False)
    if not chat:
        found.values["prompt_token_ids"] = seen[1]


async def _probe_tokenize(found: _Found, transport: AsyncTransport, worker: Worker,
                          timeout_s: float) -> None:
    body = {"model": worker.model, "prompt": PROBE_PROMPT}
    answer = await _exchange(transport, "POST", f"{worker.url}/tokenize", body, timeout_s=timeout_s)
    if not found.saw("POST /tokenize", answer):
        return
    if answer.status in _MISSING:
        found.values["tokenize"] = False
    elif answer.status == 200:
        doc = _json(answer.body)
        found.values["tokenize"] = isinstance(doc, dict) and _int_list(doc.get("tokens"))
    else:
        found.unknown("POST /tokenize", answer)


async def _probe_health(found: _Found, transport: AsyncTransport, worker: Worker,
                        timeout_s: float) -> None:
    answer = await _exchange(transport, "GET", f"{worker.url}/health", timeout_s=timeout_s)
    if not found.saw("GET /health", answer):
        return
    if answer.status == 200:
        found.values["health"] = True
    elif answer.status in _MISSING:
        found.values["health"] = False
    else:  # 503: the route is there, the engine is starting or asleep
        found.unknown("GET /health", answer)


def load_metric_from_metrics(text: bytes) -> LoadMetric:
    """Which KV-usage gauge a Prometheus text page carries ("none" when neither)."""
    for family, pattern in _METRIC_NAME.items():
        if pattern.search(text):
            return family
    return "none"


def start_time_from_metrics(text: bytes) -> float | None:
    """`process_start_time_seconds` from a Prometheus text page (None when absent or bad)."""
    match = _START_TIME.search(text)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


async def _probe_metrics(found: _Found, transport: AsyncTransport, worker: Worker,
                         timeout_s: float) -> None:
    answer = await _exchange(transport, "GET", f"{worker.url}/metrics", timeout_s=timeout_s)
    if not found.saw("GET /metrics", answer):
        return
    if answer.status in _MISSING:
        found.values["metrics"] = False
        found.values["load_metric"] = "none"
    elif answer.status == 200:
        found.values["metrics"] = True
        found.values["load_metric"] = load_metric_from_metrics(answer.body)
        found.values["process_start_time"] = start_time_from_metrics(answer.body)
    else:
        found.unknown("GET /metrics", answer)


async def _probe_sleep(found: _Found, transport: AsyncTransport, worker: Worker,
                       timeout_s: float) -> None:
    answer = await _exchange(transport, "GET", f"{worker.url}/is_sleeping", timeout_s=timeout_s)
    if not found.saw("GET /is_sleeping", answer):
        return
    if answer.status in _MISSING:
        found.values["sleep"] = False
    elif answer.status == 200:
        doc = _json(answer.body)
        asleep = doc.get("is_sleeping") if isinstance(doc, dict) else None
        found.values["sleep"] = isinstance(asleep, bool)
        if isinstance(asleep, bool):
            found.values["asleep"] = asleep
    else:
        found.unknown("GET /is_sleeping", answer)


async def _probe_kv_export(found: _Found, transport: AsyncTransport, worker: Worker,
                           timeout_s: float,
                           token: str | None) -> None:
    # A request id that cannot exist, and no `abort`: the sim's export route answers
    # 404 NotFoundError for it and touches nothing; a server without the route
    # answers its router's plain 404.
    rid = f"ftctl-capability-probe-{uuid.uuid4().hex}"
    headers = {"Authorization": f"Bearer {token}"} if token else None
    answer = await _exchange(transport, "GET", f"{worker.admin_url.rstrip('/')}/admin/kv/{rid}",
                             headers=headers, timeout_s=timeout_s)
    what = "GET /admin/kv/{id}"
    if not found.saw(what, answer):
        return
    doc = _json(answer.body)
    error = doc.get("error") if isinstance(doc, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    if answer.status == 404:
        found.values["kv_export"] = kind == "NotFoundError"
    elif answer.status in (405, 501):
        found.values["kv_export"] = False
    elif answer.status == 403:  # the sim: admin API disabled (no admin token configured)
        found.values["kv_export"] = False
        found.notes.append(f"{what}: admin API disabled (HTTP 403)")
    elif answer.status == 401:
        found.notes.append(f"{what}: needs the admin token (HTTP 401)")
    else:
        found.unknown(what, answer)


async def _probe_models(found: _Found, transport: AsyncTransport, worker: Worker,
                        timeout_s: float) -> None:
    answer = await _exchange(transport, "GET", f"{worker.url}/v1/models", timeout_s=timeout_s)
    if not found.saw("GET /v1/models", answer):
        return
    if answer.status != 200:
        found.unknown("GET /v1/models", answer)
        return
    doc = _json(answer.body)
    entries = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        found.notes.append("GET /v1/models: not a model list")
        return
    entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]
    found.values["models"] = tuple(e["id"][:200] for e in entries[:64])
    mine = [e for e in entries if e["id"] == worker.model] or entries[:1]
    if mine:
        length = mine[0].get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            found.values["max_model_len"] = length
        owner = mine[0].get("owned_by")
        if isinstance(owner, str) and owner:
            found.values["owned_by"] = owner[:40]


async def _probe_version(found: _Found, transport: AsyncTransport, worker: Worker,
                         timeout_s: float) -> None:
    answer = await _exchange(transport, "GET", f"{worker.url}/version", timeout_s=timeout_s)
    if not found.saw("GET /version", answer) or answer.status != 200:
        return
    doc = _json(answer.body)
    version = doc.get("version") if isinstance(doc, dict) else None
    if isinstance(version, str) and version:
        found.values["version"] = version[:40]


def _identity(found: _Found) -> str | None:
    parts = [str(found.values.pop(key)) for key in ("owned_by", "version")
             if key in found.values]
    if found.server_header:
        parts.append(f"({found.server_header})")
    text = " ".join(parts)
    return "".join(c if c.isprintable() else "?" for c in text) or None


def admin_token_of(worker: Worker) -> str | None:
    env = worker.admin.token_env if worker.admin else "FTCTL_ADMIN_TOKEN"
    return os.environ.get(env) or None


async def probe_capabilities(
    worker: Worker, *, transport: AsyncTransport | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    admin_token: str | None = None, clock: Clock = SYSTEM_CLOCK,
) -> Capabilities:
    """Probe one worker's capabilities, every probe at once; never raises for a missing one.

    `transport` defaults to a fresh `probe_client()` closed on return. `admin_token`
    defaults to the variable the worker's `admin.token_env` names.
    """
    if transport is None:
        own = probe_client()
        try:
            return await probe_capabilities(worker, transport=own, timeout_s=timeout_s,
                                            admin_token=admin_token, clock=clock)
        finally:
            await own.close()
    token = admin_token if admin_token is not None else admin_token_of(worker)
    found = _Found()
    start = clock.now()
    jobs = [
        _probe_generation(found, transport, worker, timeout_s, chat=False),
        _probe_generation(found, transport, worker, timeout_s, chat=True),
        _probe_tokenize(found, transport, worker, timeout_s),
        _probe_health(found, transport, worker, timeout_s),
        _probe_metrics(found, transport, worker, timeout_s),
        _probe_sleep(found, transport, worker, timeout_s),
        _probe_kv_export(found, transport, worker, timeout_s, token),
        _probe_models(found, transport, worker, timeout_s),
        _probe_version(found, transport, worker, timeout_s),
    ]
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s + _GRACE_S)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if pending:
        cut = timeout_s + _GRACE_S
        found.notes.append(f"{len(pending)} probe(s) cut at the {cut:g} s deadline")
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            found.notes.append(f"probe failed: {task.exception()!r}")  # a bug, kept visible
    server = _identity(found)
    values = found.values
    error = None
    if not found.answered:
        error = "unreachable: " + (found.failures[0] if found.failures else "no answer")
        values = {}
        server = None
        found.notes.clear()  # one failure per probe, all saying the same: `error` says it
    return Capabilities(
        worker=worker.name, url=worker.url, probed_at=clock.wall(), error=error,
        server=server, notes=tuple(found.notes), elapsed_s=round(clock.now() - start, 4),
        **values,
    )


