"""The migrating proxy against scripted fake workers (`dynamo_ftctl.httpserver` on
loopback, port 0), called through the project's own client (tests/fetch.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import pytest

from dynamo_ftctl.capabilities import PROBE_PROMPT
from dynamo_ftctl.httpserver import Reply, Request, Server, Stream, start_server
from dynamo_ftctl.inventory import Inventory
from dynamo_ftctl.inventory.proxy import ProxyConfig
from dynamo_ftctl.proxy.serve import MIGRATED_HEADER, MigratingProxy
from dynamo_ftctl.structs import convert_struct
from tests import fetch
from tests.waiting import until

if TYPE_CHECKING:
    from dynamo_ftctl.httpserver._connection import Connection

MODEL = "fake-model"


def token_at(seed: int, position: int) -> int:
    """The fake model's token at an absolute position: a byte 'A'..'Z'."""
    return 65 + (seed * 7919 + position * 104729) % 26


def _is_probe(body: dict[str, Any]) -> bool:
    """Whether `body` is one of the proxy's one-token capability probes."""
    messages = body.get("messages") or [{}]
    return body.get("max_tokens") == 1 and PROBE_PROMPT in (
        body.get("prompt"), messages[-1].get("content"))


def json_reply(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    """A JSON answer (UTF-8, as Python web frameworks label it)."""
    return Reply(status, json.dumps(doc).encode(), "application/json; charset=utf-8",
                 headers or {})


def text_reply(text: str, status: int = 200, content_type: str = "text/plain") -> Reply:
    return Reply(status, text.encode(), f"{content_type}; charset=utf-8")


def empty_reply(status: int) -> Reply:
    """A status with no body (an empty 404: a frontend without workers)."""
    return Reply(status, b"", "application/octet-stream")


def sse(doc: Any) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def hung_up() -> NoReturn:
    """Wait for the task answering a connection just hung up on to be cancelled (the
    server cancels it as the connection goes, at once); nothing more is written."""
    await asyncio.sleep(30)
    raise AssertionError("a connection hung up on was still answering after 30 s")


@dataclass
class FakeWorker:
    """A scripted OpenAI-compatible streaming worker."""

    mode: str = "ok"
    fail_after: int | None = None
    max_model_len: int = 4096
    with_ids: bool = True
    # Chat: a first chunk with the role alone (no "content": ""), then this wait.
    role_gap_s: float = 0.0
    # Refuses fields it does not know, as servers on pydantic's extra="forbid" do (400).
    strict: bool = False
    start_time: float = 1.0  # process_start_time_seconds on /metrics (a restart changes it)
    metrics_status: int = 200
    metrics_calls: int = 0
    # A request whose body holds `poison` gets `poison_answer`: "http500", "reset" (the
    # connection closed before any answer), "event<code>" (an SSE error event first),
    # "http429" (with Retry-After: 30), "http404" (empty: a frontend without workers) or
    # "killbatch" (every stream in flight ends with it, as an engine step that fails on
    # one request ends its whole batch).
    poison: str | None = None
    poison_answer: str = "http500"
    gate: asyncio.Event | None = None  # set: the first token may go
    # Streams pause after this many tokens until `resume` is set (`paused` counts them).
    hold_at: int | None = None
    resume: asyncio.Event = field(default_factory=asyncio.Event)
    paused: int = 0
    inflight: set[Connection] = field(default_factory=set)  # of streams under way
    lie_ids_at: int | None = None  # the n-th token's ids are [-5, 2**70]
    # Refuse a request whose X-Request-Id is running already (409), as vLLM does.
    unique_ids: bool = False
    running_ids: set[str] = field(default_factory=set)
    sick: bool = False  # the proxy's known-good probe gets a 500 (docs/design.md "Failure
    # attribution": only a worker that fails it has its breaker moved)
    load_text: str = "vllm:kv_cache_usage_perc 0.1\nvllm:num_requests_waiting 0\n"
    # Its usage reports prompt_tokens_details.cached_tokens: this many (at most the
    # prompt), as vLLM with --enable-prompt-tokens-details does.
    cached_tokens: int | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    disconnects: int = 0
    probes: int = 0
    url: str = ""
    server: Server | None = None  # its loopback server, once `Cluster` started it

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
            if not body.get("continue_final_message"):
                text += "<assistant>"
            return list(text.encode())
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else list(prompt.encode())

    def connection(self, request: Request) -> Connection:
        """The server's connection `request` came on (to hang up on it)."""
        assert self.server is not None
        return next(c for c in self.server.connections if c.client == request.client)

    async def route(self, request: Request) -> Reply | Stream:
        """The worker's routes; anything else is a 404."""
        where = (request.method, request.path)
        if where in {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}:
            return await self.handle(request)
        if where == ("GET", "/v1/models"):
            return self.models()
        if where == ("GET", "/metrics"):
            return self.metrics()
        return text_reply("404: Not Found", 404)

    async def handle(self, request: Request) -> Reply | Stream:
        chat = request.path.endswith("chat/completions")
        body = json.loads(request.body)
        if _is_probe(body):  # the proxy's capability probe, not a client's request
            self.probes += 1
            if self.sick:
                return json_reply({"error": {"message": "sick"}}, 500)
        else:
            self.requests.append(body)
            self.paths.append(request.path)
            self.headers.append({k.decode("latin-1"): v.decode("latin-1")
                                 for k, v in request.headers})
        return await self.answer(request, body, chat)

    async def answer(self, request: Request, body: dict[str, Any],
                     chat: bool) -> Reply | Stream:
        """What the scripted worker streams for `body`."""
        if self.strict and "return_token_ids" in body:
            return json_reply({"error": {
                "message": "1 validation error: return_token_ids: Extra inputs are not "
                           "permitted", "type": "BadRequestError", "code": 400}}, 400)
        if self.poison is not None and self.poison in json.dumps(body):
            return await self.poisoned(request)
        if self.mode == "busy429" and not _is_probe(body):
            return json_reply({"error": {"message": "busy", "code": 429}}, 429,
                              {"Retry-After": "30"})
        if self.mode == "empty404":  # a frontend whose workers are gone: probes too
            return empty_reply(404)
        if body.get("stream") is False and not _is_probe(body):
            return await self.whole_answer(request, body, chat)
        if not self.unique_ids:
            return self.stream_answer(request, body, chat)
        rid = (request.header(b"x-request-id") or b"").decode("latin-1")
        if rid in self.running_ids:
            return json_reply({"error": {
                "message": f"request id {rid} is already running", "code": 409}}, 409)
        self.running_ids.add(rid)
        answer = self.stream_answer(request, body, chat, rid)
        if not isinstance(answer, Stream):
            self.running_ids.discard(rid)
        return answer

    async def whole_answer(self, request: Request, body: dict[str, Any],
                           chat: bool) -> Reply:
        """A non-streamed answer, as vLLM makes one: the same generation, sent once it has
        ended (a break in it hangs up, stalls, or answers what the stream would carry)."""
        answer = self.stream_answer(request, body, chat)
        if not isinstance(answer, Stream):
            return answer
        docs: list[Any] = []
        async for piece in answer.chunks:
            data = piece.removeprefix(b"data: ").strip()
            if data == b"[DONE]":
                break
            try:
                docs.append(json.loads(data))
            except ValueError:
                return Reply(200, data, "application/json")  # bad_json: the garbage as is
        if docs and "error" in docs[-1]:
            error = docs[-1]["error"]
            return json_reply(docs[-1], error.get("code", 500))
        obj = "chat.completion" if chat else "text_completion"
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        usage, top, tokens = None, {}, []  # tokens: (text, ids) of each one
        for doc in docs:
            usage = doc.get("usage") or usage
            if "prompt_token_ids" in doc:
                top["prompt_token_ids"] = doc["prompt_token_ids"]
            for c in doc["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                if piece:
                    tokens.append((piece, c.get("token_ids") or []))
                choice["finish_reason"] = c["finish_reason"] or choice["finish_reason"]
                if "prompt_token_ids" in c:
                    choice["prompt_token_ids"] = c["prompt_token_ids"]
        # Stop strings, as vLLM matches them: the text ends before the first one (or with
        # it, `include_stop_str_in_output`), the count at the token that completed it.
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        text, ids = "", []
        for n, (piece, token_ids) in enumerate(tokens, 1):
            text += piece
            ids += token_ids
            hits = [(text.find(stop), stop) for stop in stops if stop in text]
            if hits:
                at, stop = min(hits)
                text = text[:at + len(stop) * bool(body.get("include_stop_str_in_output"))]
                choice["finish_reason"] = "stop"
                if usage is not None:
                    usage = {**usage, "completion_tokens": n,
                             "total_tokens": usage["prompt_tokens"] + n}
                break
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.with_ids:
            choice["token_ids"] = ids
        return json_reply({"id": "up-1", "object": obj, "model": MODEL, "choices": [choice],
                           "usage": usage, **top})

    def stream_answer(self, request: Request, body: dict[str, Any], chat: bool,
                      rid: str | None = None) -> Reply | Stream:
        """The streamed completion (or the mode's broken version of it); `rid` leaves
        `running_ids` once the stream ends."""
        if self.mode == "html502":
            return text_reply("<html><body>Bad Gateway</body></html>", 502, "text/html")
        if self.mode == "html200":
            return text_reply("<html>oops</html>", content_type="text/html")
        prompt = self.prompt_ids(body, chat)
        if len(prompt) >= self.max_model_len:
            return json_reply({"error": {"message": "prompt too long"}}, 400)
        return Stream(self.tokens(request, body, chat, prompt, rid),
                      content_type="text/event-stream")

    async def tokens(self, request: Request, body: dict[str, Any], chat: bool,
                     prompt: list[int], rid: str | None) -> AsyncIterator[bytes]:
        """The body of a streamed completion, piece by piece."""
        try:
            async for piece in self.events(request, body, chat, prompt):
                yield piece
        finally:
            if rid is not None:
                self.running_ids.discard(rid)

    async def events(self, request: Request, body: dict[str, Any], chat: bool,
                     prompt: list[int]) -> AsyncIterator[bytes]:
        """The SSE events of a completion; a break (`fail_after`) as its mode says."""
        seed = body.get("seed") or 0
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") \
            or (self.max_model_len - len(prompt))
        obj = "chat.completion.chunk" if chat else "text_completion"
        first: dict[str, Any] = {"id": "up-1", "object": obj, "model": MODEL, "choices": []}
        if chat:
            delta = {"role": "assistant"} if self.role_gap_s else \
                {"role": "assistant", "content": ""}
            first["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
            if self.with_ids:
                first["prompt_token_ids"] = prompt
            yield sse(first)
            if self.role_gap_s:
                await asyncio.sleep(self.role_gap_s)  # the role chunk arrives on its own
        if self.gate is not None and not _is_probe(body):
            await self.gate.wait()
        n = 0
        conn = self.connection(request)
        self.inflight.add(conn)
        hang_up = False
        try:
            while True:
                if self.fail_after is not None and n >= self.fail_after:
                    if self.mode == "error_event":
                        yield sse({"error": {"message": "engine died", "code": 500}})
                        return
                    if self.mode == "event429":
                        yield sse({"error": {"message": "overloaded", "code": 429}})
                        return
                    if self.mode == "bad_json":
                        yield b"data: {not json\n\n"
                        return
                    if self.mode == "no_finish":
                        yield b"data: [DONE]\n\n"
                        return
                    if self.mode == "stall":
                        await self.idle_until_disconnect(conn)
                        return
                    conn.hang_up()
                    hang_up = True
                    break
                if self.hold_at is not None and n == self.hold_at and not _is_probe(body):
                    self.paused += 1
                    await self.resume.wait()
                position = len(prompt) + n
                tid = token_at(seed, position)
                n += 1
                done = n >= max_tokens or position + 1 >= self.max_model_len
                if self.mode == "endless":
                    done = False
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if done else None,
                                          "logprobs": None}
                if chat:
                    choice["delta"] = {"content": chr(tid)}
                else:
                    choice["text"] = chr(tid)
                if self.with_ids:
                    choice["token_ids"] = [tid] if n != self.lie_ids_at else [-5, 2**70]
                    if n == 1 and not chat:
                        choice["prompt_token_ids"] = prompt
                yield sse({"id": "up-1", "object": obj, "model": MODEL, "choices": [choice]})
                await asyncio.sleep(0)
                if done:
                    break
            if not hang_up:
                usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": n,
                                         "total_tokens": len(prompt) + n}
                if self.cached_tokens is not None:
                    usage["prompt_tokens_details"] = {
                        "cached_tokens": min(self.cached_tokens, len(prompt))}
                yield sse({"id": "up-1", "object": obj, "model": MODEL, "choices": [],
                           "usage": usage})
                yield b"data: [DONE]\n\n"
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        finally:
            self.inflight.discard(conn)
        if hang_up:  # the worker's own hang-up is no client's disconnect
            await hung_up()

    async def poisoned(self, request: Request) -> Reply | Stream:
        """What an engine that breaks on the request answers (`poison_answer`)."""
        if self.poison_answer == "http500":
            return json_reply({"error": {"message": "Internal Server Error",
                                         "type": "InternalServerError", "code": 500}}, 500)
        if self.poison_answer == "http429":
            return json_reply({"error": {"message": "busy", "code": 429}}, 429,
                              {"Retry-After": "30"})
        if self.poison_answer == "http404":
            return empty_reply(404)
        if self.poison_answer == "killbatch":
            for conn in [*self.inflight, self.connection(request)]:
                conn.hang_up()
            self.resume.set()
            await hung_up()
        if self.poison_answer == "reset":
            self.connection(request).hang_up()
            await hung_up()
        code = int(self.poison_answer.removeprefix("event"))

        async def error_event() -> AsyncIterator[bytes]:
            yield sse({"error": {
                "message": f"error {code}", "type": "BadRequestError" if code < 500
                else "InternalServerError", "param": None, "code": code}})
            yield b"data: [DONE]\n\n"

        return Stream(error_event(), content_type="text/event-stream")

    def forget(self) -> None:
        """Clear what the worker saw so far (the proxy's capability probes)."""
        self.requests.clear()
        self.paths.clear()
        self.headers.clear()
        self.disconnects = 0

    async def idle_until_disconnect(self, conn: Connection) -> None:
        """Send nothing until the client hangs up (bounded: 30 s)."""
        for _ in range(3000):
            if conn.closed:
                self.disconnects += 1
                return
            await asyncio.sleep(0.01)

    def models(self) -> Reply:
        return json_reply({"object": "list", "data": [
            {"id": MODEL, "object": "model", "max_model_len": self.max_model_len}]})

    def metrics(self) -> Reply:
        self.metrics_calls += 1
        if self.metrics_status != 200:
            return empty_reply(self.metrics_status)
        return text_reply(f"{self.load_text}process_start_time_seconds {self.start_time}\n")


@pytest.fixture
def run() -> Callable[..., Any]:
    """Run a coroutine on a fresh loop (no pytest-asyncio here)."""
    def runner(coro: Any) -> Any:
        return asyncio.run(asyncio.wait_for(coro, 60))
    return runner


class Cluster:
    """Fake workers on loopback plus the proxy, its front door on `dynamo_ftctl.httpserver`
    over a loopback socket (port 0), as `serve` runs it; `client` calls it."""

    def __init__(self, workers: list[FakeWorker], **proxy: Any) -> None:
        self.workers = workers
        self.proxy_settings = proxy
        self.server: Server | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Cluster:
        for fake in self.workers:
            fake.server = await start_server(fake.route, "127.0.0.1", 0)
            fake.url = fake.server.address
        inventory = convert_struct({
            "cluster": "t",
            "workers": [{"name": f"w{i}", "url": w.url, "model": MODEL}
                        for i, w in enumerate(self.workers)],
        }, Inventory)
        settings = {"stall_timeout_s": 2.0, "scrape_interval_s": 0.05, **self.proxy_settings}
        self.proxy = MigratingProxy(inventory, convert_struct(settings, ProxyConfig))
        self.fleet = self.proxy.fleet
        await self.proxy.start()
        # A loaded test machine must not turn a probe into "unknown" (3 s by default).
        self.fleet.capabilities.timeout_s = 30.0
        await self.fleet.scrape_once()
        # The proxy probes each worker's capabilities once (docs/compatibility.md); the
        # tests look at what their own requests do, so the probes' traffic is forgotten.
        await asyncio.gather(*(self.fleet.learn(s) for s in self.fleet.balancer.slots.values()))
        for fake in self.workers:
            fake.forget()
        self.server = await start_server(self.proxy.front_door, "127.0.0.1", 0)
        self.client = await self._stack.enter_async_context(
            fetch.Session(self.server.address, timeout=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()
        if self.server is not None:
            await self.server.shutdown(5.0)
        await self.proxy.stop()
        for fake in self.workers:
            if fake.server is not None:
                await fake.server.shutdown(5.0)

    async def stop_worker(self, index: int) -> None:
        """Stop worker `index`'s server: its port refuses connections from now on."""
        server = self.workers[index].server
        assert server is not None
        await server.shutdown(5.0)

    async def stream(self, path: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None,
                     ) -> tuple[fetch.AsyncStreamed, list[Any]]:
        events: list[Any] = []
        async with self.client.stream("POST", path, json={**body, "stream": True},
                                      headers=headers) as resp:
            raw = b"".join([part async for part in resp.aiter_bytes()])
        for block in raw.split(b"\n\n"):
            if block.startswith(b"data: "):
                data = block[6:]
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            elif block.startswith(b":"):
                events.append(block.decode())
        return resp, events


def expected_text(prompt: str, seed: int, count: int) -> str:
    start = len(prompt.encode())
    return "".join(chr(token_at(seed, start + i)) for i in range(count))


def stream_text(events: list[Any], chat: bool = False) -> str:
    out = ""
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            out += (c["delta"].get("content") or "") if chat else c["text"]
    return out


BODY = {"model": MODEL, "prompt": "hello world", "max_tokens": 20, "temperature": 0.7,
        "seed": 5, "stream_options": {"include_usage": True}}


def test_stream_without_failure_passes_through(run: Callable[..., Any]) -> None:
    """A healthy stream reaches the client unchanged, with the proxy's one id and usage."""
    async def go() -> None:
        async with Cluster([FakeWorker(), FakeWorker()]) as c:
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert MIGRATED_HEADER not in resp.headers
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"] == {"prompt_tokens": 11, "completion_tokens": 20,
                                           "total_tokens": 31}
            ids = {e["id"] for e in events if isinstance(e, dict)}
            assert len(ids) == 1
            assert all("token_ids" not in e["choices"][0] for e in events
                       if isinstance(e, dict) and e["choices"])
    run(go())


@pytest.mark.parametrize("cut", [1, 7, 19])
def test_stream_broken_midway_continues_identically(run: Callable[..., Any], cut: int) -> None:
    """A worker dropping the connection after `cut` tokens: the client sees one identical stream."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=cut), FakeWorker()]) as c:
            # make the breaking worker the router's first choice
            c.fleet.balancer.slots["w1"].outstanding = 5
            _, events = await c.stream("/v1/completions", BODY)
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert stream_text(events) == expected_text("hello world", 5, 20)
            usage = events[-3]["usage"]
            assert usage["completion_tokens"] == 20
            assert events[-2] == f": {MIGRATED_HEADER}: 1"
            continuation = c.workers[1].requests[-1]
            assert continuation["prompt"][:11] == list(b"hello world")
            assert len(continuation["prompt"]) == 11 + cut
            assert continuation["max_tokens"] == 20 - cut
            assert continuation["seed"] == 5
    run(go())


def migrations(method: str) -> float:
    """ftctl_migrations_total from w0 to w1 by `method` (the registry is per process)."""
    from dynamo_ftctl import metrics

    return metrics.REGISTRY.get_sample_value(
        "ftctl_migrations_total", {"source_group": "w0", "target_group": "w1",
                                   "method": method}) or 0.0


def prompt_tokens(method: str, kind: str) -> float:
    """ftctl_migration_prompt_tokens_total by `method` and `kind`."""
    from dynamo_ftctl import metrics

    return metrics.REGISTRY.get_sample_value(
        "ftctl_migration_prompt_tokens_total", {"method": method, "kind": kind}) or 0.0


@pytest.mark.parametrize(("cached", "method", "loaded"), [
    (None, "reprefill", None),  # no prompt_tokens_details: it cannot tell, nothing counted
    (0, "reprefill", 0),
    (8, "reprefill", 8),  # within the client's 11-token prompt: the prefix cache's
    (11, "reprefill", 11),
    (16, "kv", 16),  # past the prompt: ids only the cut worker computed, loaded
    (10_000, "kv", 18),  # the whole continued prompt (11 + 7)
])
def test_a_continuation_that_loaded_kv_counts_as_method_kv(
    run: Callable[..., Any], cached: int | None, method: str, loaded: int | None,
) -> None:
    """A re-prefill continuation whose worker reports more cached tokens than the client's
    prompt counts as a migration of method "kv" (loaded past what its prefix cache can
    hold), else "reprefill"; its prompt tokens are counted loaded and recomputed."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=7), FakeWorker(cached_tokens=cached)]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            before = {m: migrations(m) for m in ("kv", "reprefill")}
            tokens = {(m, k): prompt_tokens(m, k) for m in ("kv", "reprefill")
                      for k in ("loaded", "recomputed")}
            _, events = await c.stream("/v1/completions", BODY)
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert stream_text(events) == expected_text("hello world", 5, 20)
            other = "kv" if method == "reprefill" else "reprefill"
            assert migrations(method) == before[method] + 1
            assert migrations(other) == before[other]
            grew = {key: prompt_tokens(*key) - was for key, was in tokens.items()}
            if loaded is None:
                assert not any(grew.values())
            else:
                assert grew == {(method, "loaded"): loaded, (method, "recomputed"): 18 - loaded,
                                (other, "loaded"): 0, (other, "recomputed"): 0}
    run(go())


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 15, "temperature": 0}


def test_chat_continuation_goes_on_from_token_ids(run: Callable[..., Any]) -> None:
    """A chat stream broken midway goes on token-exactly: a completion of the rendered
    prompt's ids + the generated ids, relayed to the client as chat chunks, counted once
    as a re-prefill migration, never re-sending the generated text."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=6), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            before = migrations("reprefill")
            resp, events = await c.stream("/v1/chat/completions", CHAT)
            assert migrations("reprefill") == before + 1
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert "x-ftctl-continuation" not in resp.headers
            text = stream_text(events, chat=True)
            rendered = list(b"<user>hi<assistant>")
            generated = [token_at(0, len(rendered) + i) for i in range(15)]
            assert text == "".join(map(chr, generated))
            chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
            assert {e["object"] for e in chunks} == {"chat.completion.chunk"}
            assert all("text" not in e["choices"][0] for e in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            roles = [e for e in chunks if "role" in e["choices"][0]["delta"]]
            assert len(roles) == 1
            assert c.workers[1].paths[-1] == "/v1/completions"
            cont = c.workers[1].requests[-1]
            assert cont["prompt"] == rendered + generated[:6]
            assert cont["max_tokens"] == 9
            assert cont["return_token_ids"] is True
            assert not {"messages", "max_completion_tokens", "continue_final_message",
                        "add_generation_prompt"} & set(cont)
    run(go())


def test_chat_without_ids_continues_with_continue_final_message(run: Callable[..., Any]) -> None:
    """From workers that return no ids, a broken chat goes on with the text so far as the
    final assistant message, announced as a text continuation and counted once. The
    continuation's first chunk, alone in its read, carries only the role (nothing for
    the client): its first token is still what counts the migration, not the fast lane."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=6, with_ids=False),
                            FakeWorker(role_gap_s=0.05, with_ids=False)]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            before = migrations("text")
            resp, events = await c.stream("/v1/chat/completions", CHAT)
            assert migrations("text") == before + 1
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert resp.headers["x-ftctl-continuation"] == "text"
            text = stream_text(events, chat=True)
            rendered = "<user>hi<assistant>"
            assert text == "".join(chr(token_at(0, len(rendered) + i)) for i in range(15))
            roles = [e for e in events if isinstance(e, dict) and e["choices"]
                     and "role" in e["choices"][0]["delta"]]
            assert len(roles) == 1
            assert c.workers[1].paths[-1] == "/v1/chat/completions"
            cont = c.workers[1].requests[-1]
            assert cont["continue_final_message"] is True
            assert cont["add_generation_prompt"] is False
            assert cont["messages"][-1] == {"role": "assistant", "content": text[:6]}
    run(go())


def test_non_streaming_request_is_migrated(run: Callable[..., Any]) -> None:
    """A non-streamed request broken midway still gets one complete JSON answer."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=4), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            doc = resp.json()
            assert resp.status == 200
            assert resp.headers[MIGRATED_HEADER] == "1"
            assert doc["choices"][0]["text"] == expected_text("hello world", 5, 20)
            assert doc["choices"][0]["finish_reason"] == "length"
            assert doc["usage"]["completion_tokens"] == 20
    run(go())


@pytest.mark.parametrize("mode", ["html502", "html200", "bad_json", "error_event", "no_finish",
                                  "endless", "stall"])
@pytest.mark.parametrize("sick", [False, True])
def test_garbage_from_a_worker_is_a_failure(run: Callable[..., Any], mode: str,
                                            sick: bool) -> None:
    """Bad JSON, HTML pages, error events, endless or stalled streams never reach the client
    (over the lean front door, after the first tokens they reach the proxy's fast lane); the
    worker is charged, and its breaker counts the failure only when it fails the known-good
    probe too (the HTML pages fail it whatever)."""
    async def go() -> None:
        # An endless worker streams past max_tokens and never hangs up by itself.
        bad = FakeWorker(mode=mode, fail_after=None if mode == "endless" else 3, sick=sick)
        async with Cluster([bad, FakeWorker()], stall_timeout_s=0.3) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert all("error" not in e for e in events if isinstance(e, dict))
            w0 = c.fleet.balancer.slots["w0"]
            assert w0.charges == 1
            confirmed = sick or mode.startswith("html") or mode == "endless"  # no end: fails it
            await until(lambda: w0.failures == int(confirmed) and not c.fleet._confirming)
    run(go())


def test_migration_limit_reached_ends_with_an_error_event(run: Callable[..., Any]) -> None:
    """When every worker breaks, the stream ends with an error event and [DONE], no hang."""
    async def go() -> None:
        workers = [FakeWorker(fail_after=3) for _ in range(3)]
        async with Cluster(workers, migration_limit=1) as c:
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert events[-1] == "[DONE]"
            assert "migration limit reached (1)" in events[-2]["error"]["message"]
            assert len(stream_text(events)) == 6
    run(go())


def test_migration_limit_zero_disables_migration(run: Callable[..., Any]) -> None:
    """With migration_limit 0 a broken stream is not continued anywhere."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=3), FakeWorker(fail_after=3)],
                           migration_limit=0) as c:
            _, events = await c.stream("/v1/completions", BODY)
            assert "error" in events[-2]
            assert sum(len(w.requests) for w in c.workers) == 1
    run(go())


def test_max_length_reached_is_not_migrated(run: Callable[..., Any]) -> None:
    """At the model's max length a broken stream ends with finish_reason length, not a retry."""
    async def go() -> None:
        prompt = "x" * 50
        workers = [FakeWorker(fail_after=10, max_model_len=60), FakeWorker(max_model_len=60)]
        async with Cluster(workers) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            _, events = await c.stream("/v1/completions", {**BODY, "prompt": prompt,
                                                           "max_tokens": 100})
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert len(stream_text(events)) == 10
            assert not c.workers[1].requests
    run(go())


def test_connection_refused_is_retried_elsewhere(run: Callable[..., Any]) -> None:
    """A worker that refuses connections costs a plain retry on another worker."""
    async def go() -> None:
        async with Cluster([FakeWorker(), FakeWorker()]) as c:
            await c.stop_worker(0)
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert c.fleet.balancer.slots["w0"].failures == 1
    run(go())


def test_worker_4xx_is_passed_to_the_client(run: Callable[..., Any]) -> None:
    """A request the worker refuses (400) is the client's error, not a worker failure."""
    async def go() -> None:
        async with Cluster([FakeWorker(max_model_len=5)]) as c:
            resp = await c.client.post("/v1/completions", json=BODY)
            assert resp.status == 400
            assert resp.json()["error"]["message"] == "prompt too long"
            assert c.fleet.balancer.slots["w0"].failures == 0
    run(go())


def test_text_fallback_for_workers_without_ids(run: Callable[..., Any]) -> None:
    """Without token ids the proxy continues from text and says so in a header."""
    async def go() -> None:
        workers = [FakeWorker(fail_after=5, with_ids=False), FakeWorker(with_ids=False)]
        async with Cluster(workers) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.headers["x-ftctl-continuation"] == "text"
            assert resp.json()["choices"][0]["text"] == expected_text("hello world", 5, 20)
            assert c.workers[1].requests[-1]["prompt"] == "hello world" + \
                expected_text("hello world", 5, 5)
    run(go())


def test_all_workers_busy_answers_503_with_retry_after(run: Callable[..., Any]) -> None:
    """Every worker above the KV threshold: 503, Retry-After and the exact busy body."""
    async def go() -> None:
        async with Cluster([FakeWorker(), FakeWorker()],
                           busy={"active_decode_blocks_threshold": 0.05}) as c:
            resp = await c.client.post("/v1/completions", json=BODY)
            assert resp.status == 503
            assert resp.headers["retry-after"] == "1"
            assert resp.json() == {
                "message": "Service temporarily unavailable: All workers are busy, please "
                           "retry later",
                "type": "service_unavailable", "code": 503}
            ok = await c.client.post("/busy_threshold", json={
                "model": MODEL, "active_decode_blocks_threshold": 0.5})
            assert ok.status in (401, 403)
    run(go())


def test_busy_threshold_changes_at_run_time(run: Callable[..., Any],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """POST /busy_threshold with the admin token lifts the rejection at once."""
    monkeypatch.setenv("FTCTL_ADMIN_TOKEN", "s3cret")

    async def go() -> None:
        async with Cluster([FakeWorker()], reject_status=529,
                           busy={"active_decode_blocks_threshold": 0.05}) as c:
            assert (await c.client.post("/v1/completions", json=BODY)).status == 529
            bad = await c.client.post("/busy_threshold", json={"model": MODEL},
                                      headers={"Authorization": "Bearer nope"})
            assert bad.status == 401
            ok = await c.client.post(
                "/busy_threshold", headers={"Authorization": "Bearer s3cret"},
                json={"model": MODEL, "active_decode_blocks_threshold": 0.5})
            assert ok.json() == {"model": MODEL, "active_decode_blocks_threshold": 0.5,
                                 "active_prefill_tokens_threshold": 8192}
            got = await c.client.get("/busy_threshold", params={"model": MODEL})
            assert got.json()["active_decode_blocks_threshold"] == 0.5
            assert (await c.client.post("/v1/completions", json=BODY)).status == 200
    run(go())


def test_busy_threshold_takes_the_token_only_as_a_bearer_header(
        run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`bearer` in any case is taken; a bare token, another scheme, another header or the
    query string is a 401 (with WWW-Authenticate); no token configured is a 403."""
    monkeypatch.setenv("FTCTL_ADMIN_TOKEN", "s3cret")
    change = {"model": MODEL, "active_decode_blocks_threshold": 0.5}
    refused: list[tuple[dict[str, str], dict[str, str]]] = [
        ({"Authorization": "s3cret"}, {}), ({"Authorization": "Basic s3cret"}, {}),
        ({"Authorization": "Bearer"}, {}), ({"Authorization": "Bearer s3cret2"}, {}),
        ({"X-Admin-Token": "s3cret"}, {}), ({"Proxy-Authorization": "Bearer s3cret"}, {}),
        ({}, {"token": "s3cret"}), ({}, {"access_token": "s3cret"}),
    ]

    async def go() -> None:
        async with Cluster([FakeWorker()]) as c:
            for headers, params in refused:
                answer = await c.client.post("/busy_threshold", json=change, headers=headers,
                                             params=params)
                assert answer.status == 401, (headers, params)
                assert answer.headers["www-authenticate"] == "Bearer"
                assert answer.json()["error"]["type"] == "unauthorized"
            assert c.fleet.thresholds[MODEL].active_decode_blocks_threshold == 0.85
            for scheme in ("bearer", "BEARER", "Bearer"):
                answer = await c.client.post("/busy_threshold", json=change,
                                             headers={"authorization": f"{scheme} s3cret"})
                assert answer.status == 200, scheme
            monkeypatch.delenv("FTCTL_ADMIN_TOKEN")
            answer = await c.client.post("/busy_threshold", json=change,
                                         headers={"Authorization": "Bearer s3cret"})
            assert answer.status == 403
            assert "FTCTL_ADMIN_TOKEN is not set" in answer.json()["error"]["message"]
    run(go())


def test_metrics_and_health_are_served(run: Callable[..., Any]) -> None:
    """/metrics carries the migration counter after a migration; /health names the workers."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=2), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            await c.stream("/v1/completions", BODY)
            text = (await c.client.get("/metrics")).text
            assert 'ftctl_migrations_total{method="reprefill",source_group="w0",' \
                   'target_group="w1"}' in text
            health = (await c.client.get("/health")).json()
            assert set(health["workers"]) == {"w0", "w1"}
            models = (await c.client.get("/v1/models")).json()
            assert models["data"][0]["max_model_len"] == 4096
    run(go())


def dynamo_migrations(migration_type: str) -> float:
    """The Dynamo mirror `dynamo_frontend_model_migration_total` for MODEL."""
    from dynamo_ftctl import metrics

    return metrics.REGISTRY.get_sample_value(
        "dynamo_frontend_model_migration_total",
        {"model": MODEL, "migration_type": migration_type}) or 0.0


def test_migrations_are_mirrored_under_dynamos_name(run: Callable[..., Any]) -> None:
    """A cut stream counts once as Dynamo's ongoing_request, a failure before any token as
    new_request, with Dynamo's labels (model, migration_type)."""
    async def go() -> None:
        ongoing, new = dynamo_migrations("ongoing_request"), dynamo_migrations("new_request")
        async with Cluster([FakeWorker(fail_after=2), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            await c.stream("/v1/completions", BODY)
            assert dynamo_migrations("ongoing_request") == ongoing + 1
            assert dynamo_migrations("new_request") == new
        async with Cluster([FakeWorker(mode="html502"), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            await c.stream("/v1/completions", BODY)
            assert dynamo_migrations("new_request") == new + 1
            text = (await c.client.get("/metrics")).text
            assert f'dynamo_frontend_model_migration_total{{migration_type="new_request",' \
                   f'model="{MODEL}"}}' in text
    run(go())


def dynamo_migration_seconds(migration_type: str, outcome: str) -> float:
    """How many migrations of MODEL Dynamo's duration histogram holds for these labels."""
    from dynamo_ftctl import metrics

    return metrics.REGISTRY.get_sample_value(
        "dynamo_frontend_model_migration_duration_seconds_count",
        {"model": MODEL, "migration_type": migration_type, "outcome": outcome}) or 0.0


def test_proxy_metrics_mirror_dynamos_migration_series(run: Callable[..., Any]) -> None:
    """/metrics has Dynamo's three migration families with Dynamo's names, types and label
    names, a duration per migration by outcome, and no `_created` series at all."""
    from prometheus_client.parser import text_string_to_metric_families

    async def go() -> None:
        success = dynamo_migration_seconds("ongoing_request", "success")
        failure = dynamo_migration_seconds("ongoing_request", "failure")
        async with Cluster([FakeWorker(fail_after=2), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            await c.stream("/v1/completions", BODY)
            assert dynamo_migration_seconds("ongoing_request", "success") == success + 1
            text = (await c.client.get("/metrics")).text
        async with Cluster([FakeWorker(fail_after=2)]) as c:  # cut, and nowhere to go
            await c.stream("/v1/completions", BODY)
            assert dynamo_migration_seconds("ongoing_request", "failure") == failure + 1
        assert "_created" not in text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        expected = {
            "dynamo_frontend_model_migration": ("counter", {"model", "migration_type"}),
            "dynamo_frontend_model_migration_duration_seconds":
                ("histogram", {"model", "migration_type", "outcome"}),
            "dynamo_frontend_model_migration_limit": ("gauge", {"model"}),
        }
        for name, (kind, labels) in expected.items():
            family = families[name]
            assert family.type == kind, name
            assert family.samples, name
            for sample in family.samples:
                assert set(sample.labels) - {"le"} == labels, sample
        assert families["dynamo_frontend_model_migration_limit"].samples[0].value == 3
        buckets = [s.labels["le"] for s in
                   families["dynamo_frontend_model_migration_duration_seconds"].samples
                   if s.name.endswith("_bucket")]
        assert buckets[:12] == ["0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
                                "1.0", "2.5", "5.0", "10.0", "+Inf"]
    run(go())



@pytest.mark.parametrize(("streamed", "whole"), [(True, 0), (False, 0), (False, 20)],
                         ids=["streamed", "unstreamed", "whole"])
def test_client_hang_up_cancels_the_upstream_request(
        run: Callable[..., Any], streamed: bool, whole: int) -> None:
    """A client that hangs up mid-generation (streamed, not, or waiting for a whole
    answer) makes the proxy drop upstream."""
    async def go() -> None:
        slow = FakeWorker(mode="stall", fail_after=2)
        async with Cluster([slow], stall_timeout_s=20, whole_max_tokens=whole) as c:
            assert c.server is not None
            port = int(c.server.address.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({**BODY, "stream": streamed}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await until(lambda: bool(slow.requests))
            if streamed:  # the first tokens came through before the worker stalled
                assert b"200 OK" in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.close()
            await until(lambda: slow.disconnects == 1)
            await until(lambda: c.fleet.balancer.slots["w0"].outstanding == 0)
            await until(lambda: not c.server.tasks)
    run(go())


def test_slow_reader_gets_every_token_in_order(run: Callable[..., Any]) -> None:
    """A long stream to a client that reads nothing until the proxy's writer is blocked: the
    client's socket backs up (the fast lane gives way to the waiting writer, then takes over
    again) and the client gets every token once, in order, then the usage and [DONE]. Small
    socket buffers and 3000 tokens (far more than they and the transport's high-water mark
    hold) make the backlog certain whatever the scheduler does."""
    count = 3000

    async def go() -> bytes:
        async with Cluster([FakeWorker()]) as c:
            assert c.server is not None
            port = int(c.server.address.rsplit(":", 1)[1])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
            await until(lambda: bool(c.server.connections))
            for conn in c.server.connections:  # small buffers: the backlog shows at once
                assert conn.transport is not None
                conn.transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            body = json.dumps({**BODY, "max_tokens": count, "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            # The proxy has to wait for this client: nothing is read until it does.
            await until(lambda: any(x.writing_paused for x in c.server.connections), 30,
                        "the proxy's writer to this client paused (socket backed up)")
            raw = b""
            while piece := await reader.read(4096):
                raw += piece
            writer.close()
            return raw

    raw = run(go())
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    data = b""
    while chunked:
        size_line, _, chunked = chunked.partition(b"\r\n")
        size = int(size_line, 16)
        data += chunked[:size]
        chunked = chunked[size + 2:]
    events = [b.removeprefix(b"data: ") for b in data.split(b"\n\n") if b]
    assert events[-1] == b"[DONE]"
    docs = [json.loads(e) for e in events[:-1]]
    assert stream_text(docs) == expected_text("hello world", 5, count)
    assert docs[-1]["usage"]["completion_tokens"] == count


@contextlib.asynccontextmanager
async def fake_daemon(weights: dict[str, float]) -> AsyncIterator[tuple[str, list[Any]]]:
    """A stand-in canary daemon on loopback: GET /workers from `weights`, POST /report kept
    (with its Authorization header)."""
    reports: list[Any] = []

    async def route(request: Request) -> Reply:
        where = (request.method, request.path)
        if where == ("GET", "/workers"):
            return json_reply({"workers": [{"name": n, "weight": w}
                                           for n, w in weights.items()]})
        if where == ("POST", "/report"):
            authorization = request.header(b"authorization")
            reports.append({**json.loads(request.body), "authorization":
                            None if authorization is None else authorization.decode()})
            return empty_reply(204)
        return text_reply("404: Not Found", 404)

    daemon = await start_server(route, "127.0.0.1", 0)
    try:
        yield daemon.address, reports
    finally:
        await daemon.shutdown(5.0)


@pytest.mark.parametrize("token", ["d4emon", None])
def test_canary_daemon_weights_route_and_failures_are_reported(
        run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, token: str | None) -> None:
    """Daemon weight 0 keeps a worker out of routing; a worker failure is POSTed to /report
    with the daemon's bearer token ($FTCTL_DAEMON_TOKEN), and not at all without one."""
    if token is None:
        monkeypatch.delenv("FTCTL_DAEMON_TOKEN", raising=False)
    else:
        monkeypatch.setenv("FTCTL_DAEMON_TOKEN", token)

    async def go() -> None:
        async with fake_daemon({"w0": 1.0, "w1": 1.0, "w2": 0.0}) as (url, reports):
            fakes = [FakeWorker(fail_after=3, sick=True), FakeWorker(), FakeWorker()]
            async with Cluster(fakes, health_url=url) as c:
                assert c.fleet.balancer.healthy_capacity() == pytest.approx(2 / 3)
                c.fleet.balancer.slots["w1"].outstanding = 5
                _, events = await c.stream("/v1/completions", BODY)
                c.fleet.balancer.slots["w1"].outstanding = 0
                assert stream_text(events) == expected_text("hello world", 5, 20)
                assert not fakes[2].requests
                if token is None:
                    await c.fleet.scrape_once()  # the next daemon round trip: still none
                    assert reports == []
                    return
                await until(lambda: bool(reports))
                assert reports[0]["worker"] == "w0"
                assert reports[0]["ok"] is False
                assert reports[0]["source"] == "proxy"
                assert reports[0]["authorization"] == f"Bearer {token}"
                text = (await c.client.get("/metrics")).text
                count = next(line for line in text.splitlines()
                             if line.startswith("ftctl_migration_duration_seconds_count"))
                assert float(count.rsplit(" ", 1)[1]) >= 1
    run(go())


def test_several_daemons_first_answering_gives_weights_and_none_fails_open(
        run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Two daemons, the first dead: the second's weights route and a failure is reported to
    it; both dead: the proxy's own breakers decide (every worker routable again), with one
    log line, and `daemon_up` says so."""
    monkeypatch.setenv("FTCTL_DAEMON_TOKEN", "d4emon")
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def go() -> None:
        async with fake_daemon({"w0": 1.0, "w1": 1.0, "w2": 0.0}) as (url, reports):
            fakes = [FakeWorker(fail_after=3, sick=True), FakeWorker(), FakeWorker()]
            async with Cluster(fakes, health_url=(dead, url)) as c:
                assert c.fleet.daemon_up is True
                assert c.fleet.balancer.healthy_capacity() == pytest.approx(2 / 3)
                c.fleet.balancer.slots["w1"].outstanding = 5
                await c.stream("/v1/completions", BODY)
                c.fleet.balancer.slots["w1"].outstanding = 0
                await until(lambda: bool(reports))
                assert reports[0]["worker"] == "w0"
                c.fleet.config = msgspec.structs.replace(c.fleet.config,
                                                         health_url=(dead, dead))
                with caplog.at_level("WARNING", logger="ftctl.proxy"):
                    await c.fleet.scrape_once()
                    await c.fleet.scrape_once()
                assert c.fleet.daemon_up is False
                assert c.fleet.balancer.slots["w2"].daemon_weight is None
                said = [r.getMessage() for r in caplog.records
                        if "no canary daemon answers" in r.getMessage()]
                assert len(said) == 1
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_n_above_one_is_refused_with_an_openai_400(run: Callable[..., Any], stream: bool) -> None:
    """n=2 gets HTTP 400 in OpenAI's error format naming 'n'; no worker is asked."""
    async def go() -> None:
        fake = FakeWorker()
        async with Cluster([fake]) as c:
            resp = await c.client.post("/v1/completions",
                                       json={**BODY, "n": 2, "stream": stream})
            assert resp.status == 400
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == "n"
            assert error["code"] == 400
            assert "n=1 only" in error["message"]
            assert fake.requests == []
    run(go())


def test_stop_string_across_the_failure_point_stops_like_an_unbroken_run(
    run: Callable[..., Any],
) -> None:
    """A stop string begun before a migration and ended after it cuts the output before it."""
    full = expected_text("hello world", 5, 20)
    stop = full[6:10]  # tokens 6-7 on the first worker, 8-9 on the second
    assert full.find(stop) == 6

    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=8), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            _, events = await c.stream("/v1/completions", {**BODY, "stop": [stop]})
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert stream_text(events) == full[:6]
            finishes = [e["choices"][0]["finish_reason"] for e in events
                        if isinstance(e, dict) and e.get("choices")]
            assert finishes[-1] == "stop"
            assert events[-3]["usage"]["completion_tokens"] == 10
            assert events[-2] == f": {MIGRATED_HEADER}: 1"
            assert all("stop" not in body for w in c.workers for body in w.requests)
    run(go())


def test_kv_preferred_but_not_exportable_falls_back_to_reprefill(
    run: Callable[..., Any], tmp_path: Path,
) -> None:
    """Calibration says kv, the failed worker has no KV export: re-prefill, output unchanged."""
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({
        "worker": "a", "peer": "b", "model": MODEL, "layers": 2, "kv_heads": 2, "head_dim": 32,
        "dtype_bytes": 4, "block_size": 16,
        "prefill": {"fixed_s": 0.0, "per_token_s": 1e-3},
        "transfer": {"setup_s": 1e-4, "bandwidth_bytes_per_s": 1e9},
    }))

    def count(method: str) -> float:
        from dynamo_ftctl import metrics

        return metrics.REGISTRY.get_sample_value(
            "ftctl_migrations_total", {"source_group": "w0", "target_group": "w1",
                                       "method": method}) or 0.0

    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=7), FakeWorker()],
                           calibration=str(calibration)) as c:
            assert c.proxy.kv.calibration is not None
            c.fleet.balancer.slots["w1"].outstanding = 5
            before = (count("kv"), count("reprefill"))
            _, events = await c.stream("/v1/completions", BODY)
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert (count("kv"), count("reprefill")) == (before[0], before[1] + 1)
    run(go())


def test_request_id_of_the_client_reaches_every_worker_and_comes_back(
        run: Callable[..., Any]) -> None:
    """The client's X-Request-Id comes back and reaches each worker of a migrated stream as
    X-Ftctl-Trace-Id; each attempt's own X-Request-Id is a fresh UUID (servers that validate
    the id refuse anything else), never the client's."""
    import uuid

    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=3), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp, events = await c.stream("/v1/completions", BODY,
                                          headers={"X-Request-Id": "trace-7"})
            assert resp.headers["x-request-id"] == "trace-7"
            heads = [h for w in c.workers for h in w.headers]
            assert [h["x-ftctl-trace-id"] for h in heads] == ["trace-7", "trace-7"]
            ids = [h["x-request-id"] for h in heads]
            assert len(set(ids)) == 2
            assert all(uuid.UUID(i).version == 4 for i in ids)
            assert {e["id"] for e in events if isinstance(e, dict)} == {"cmpl-trace-7"}
            c.fleet.balancer.slots["w1"].outstanding = 0
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            head = c.workers[0].headers[-1]
            assert uuid.UUID(head["x-request-id"]).version == 4
            assert resp.headers["x-request-id"] == head["x-ftctl-trace-id"]
            assert uuid.UUID(resp.headers["x-request-id"]).version == 4
    run(go())


STRICT = {"strict": True, "with_ids": False}


def test_a_worker_that_refuses_return_token_ids_is_never_sent_it(
        run: Callable[..., Any]) -> None:
    """Its probe finds the field refused: requests go without it, a broken stream goes on
    as a text continuation (announced), and no request is refused."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=4, **STRICT), FakeWorker(**STRICT)]) as c:
            assert all(s.token_ids == {"completions": False, "chat": False}
                       for s in c.fleet.balancer.slots.values())
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp, events = await c.stream("/v1/completions", BODY)
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert resp.status == 200
            assert resp.headers["x-ftctl-continuation"] == "text"
            assert stream_text(events) == expected_text("hello world", 5, 20)
            sent = c.workers[0].requests + c.workers[1].requests
            assert sent
            assert all("return_token_ids" not in r for r in sent)
            assert c.workers[1].requests[-1]["prompt"] == "hello world" + \
                expected_text("hello world", 5, 4)
    run(go())


def test_a_refusal_naming_return_token_ids_is_learnt_and_the_request_sent_again(
        run: Callable[..., Any]) -> None:
    """A worker replaced by a strict one before its probe: the refused request is sent
    again without the field (the client never sees the 400), and later ones go without."""
    async def go() -> None:
        async with Cluster([FakeWorker(**STRICT)]) as c:
            slot = c.fleet.balancer.slots["w0"]
            slot.token_ids = {"completions": None, "chat": None}
            for _ in range(2):
                resp, events = await c.stream("/v1/completions", BODY)
                assert resp.status == 200
                assert stream_text(events) == expected_text("hello world", 5, 20)
            assert ["return_token_ids" in r for r in c.workers[0].requests] == \
                [True, False, False]
            assert slot.token_ids["completions"] is False
    run(go())


def test_a_refusal_learnt_meanwhile_by_the_probe_still_sends_the_request_again(
        run: Callable[..., Any]) -> None:
    """The capability probe learns that the worker refuses the field while a request that
    holds it is in flight (a proxy's first request, Hugging Face serve's 422): the client
    still gets its stream, from the request sent again without the field."""
    async def go() -> None:
        async with Cluster([FakeWorker(**STRICT)]) as c:
            slot = c.fleet.balancer.slots["w0"]
            slot.token_ids = {"completions": None, "chat": None}
            fake = c.workers[0]
            answer = fake.answer

            async def probe_learns_first(request: Any, body: dict[str, Any],
                                         chat: bool) -> Any:
                slot.token_ids["completions"] = False  # the probe's finding, meanwhile
                return await answer(request, body, chat)

            fake.answer = probe_learns_first  # type: ignore[method-assign]
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert ["return_token_ids" in r for r in fake.requests] == [True, False]
    run(go())


def test_a_restarted_worker_is_probed_again(run: Callable[..., Any]) -> None:
    """A new process_start_time_seconds on a worker's /metrics: its capabilities are probed
    again (a worker may come back as another server)."""
    async def go() -> None:
        async with Cluster([FakeWorker()]) as c:
            slot = c.fleet.balancer.slots["w0"]
            assert slot.token_ids == {"completions": True, "chat": True}
            fake = c.workers[0]
            fake.strict, fake.with_ids, fake.start_time = True, False, 2.0
            await c.fleet.scrape_once()
            await until(lambda: slot.token_ids == {"completions": False, "chat": False})
            assert fake.probes >= 2  # once at the start, again after the restart
    run(go())


def test_what_a_worker_lacks_is_not_scraped_again(run: Callable[..., Any]) -> None:
    """A worker whose probe found no /metrics is not asked for it at every scrape."""
    async def go() -> None:
        async with Cluster([FakeWorker(metrics_status=404)]) as c:
            asked = c.workers[0].metrics_calls
            for _ in range(5):
                await c.fleet.scrape_once()
            assert c.workers[0].metrics_calls == asked
            assert c.fleet.balancer.slots["w0"].max_model_len == 4096
    run(go())


FULL_AND_IDLE = ("vllm:kv_cache_usage_perc 0.97\nvllm:num_requests_waiting 0\n"
                 "vllm:num_requests_running 0\n")
FULL_AND_RUNNING = ("vllm:kv_cache_usage_perc 0.97\nvllm:num_requests_waiting 0\n"
                    "vllm:num_requests_running 2\n")


def test_worker_whose_metrics_say_full_but_runs_nothing_is_not_busy(
        run: Callable[..., Any]) -> None:
    """KV 0.97 forever with nothing running or waiting: requests are admitted, not shed."""
    async def go() -> None:
        async with Cluster([FakeWorker(load_text=FULL_AND_IDLE)]) as c:
            for _ in range(3):
                assert (await c.client.post("/v1/completions", json=BODY)).status == 200
            c.workers[0].load_text = FULL_AND_RUNNING
            await c.fleet.scrape_once()
            assert (await c.client.post("/v1/completions", json=BODY)).status == 503
    run(go())


def test_busy_flag_and_gauge_follow_the_scrapes_without_traffic(run: Callable[..., Any]) -> None:
    """/health and ftctl_worker_busy change with the worker's metrics, no request needed."""
    async def go() -> None:
        async with Cluster([FakeWorker()]) as c:
            async def busy() -> tuple[bool, str]:
                health = (await c.client.get("/health")).json()
                text = (await c.client.get("/metrics")).text
                return health["workers"]["w0"]["busy"], text

            assert (await busy())[0] is False
            c.workers[0].load_text = FULL_AND_RUNNING
            flags: list[bool] = []

            async def check() -> bool:
                flag, text = await busy()
                flags.append(flag and 'ftctl_worker_busy{worker="w0"} 1.0' in text)
                return flags[-1]

            for _ in range(200):  # scrapes every 0.05 s: bounded wait, no request sent
                if await check():
                    break
                await asyncio.sleep(0.01)
            assert flags[-1]
            assert c.workers[0].requests == []
            c.workers[0].load_text = FULL_AND_IDLE
            await until(lambda: not c.fleet.balancer.slots["w0"].busy)  # only a scrape sets it
            assert 'ftctl_worker_busy{worker="w0"} 0.0' in (await c.client.get("/metrics")).text
    run(go())


def test_own_kv_count_grows_with_a_request_and_is_zero_once_it_ends(
        run: Callable[..., Any]) -> None:
    """The proxy's KV blocks on a worker: prompt + output while a request runs there, 0
    after it ends, whether it finished, moved to another worker, or its client left."""
    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=7), FakeWorker()]) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5  # w0 first: it breaks after 7 tokens
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert resp.headers[MIGRATED_HEADER] == "1"
            assert [s.kv_blocks for s in c.fleet.balancer.slots.values()] == [0, 0]
        # Blocks of one token: the count is the tokens.
        slow = FakeWorker(mode="stall", fail_after=3, load_text=FakeWorker.load_text + (
            'vllm:cache_config_info{block_size="1",num_gpu_blocks="100000"} 1\n'))
        async with Cluster([slow], stall_timeout_s=20) as c:
            slot = c.fleet.balancer.slots["w0"]
            async with c.client.stream("POST", "/v1/completions",
                                       json={**BODY, "stream": True}) as resp:
                async for _ in resp.aiter_bytes():
                    break
                # "hello world": 3 tokens by the proxy's estimate, then 3 generated.
                await until(lambda: slot.kv_blocks == 6)
            await until(lambda: slot.kv_blocks == 0)  # the client hung up
    run(go())


@pytest.mark.parametrize(("setup_s", "bypass"), [(10.0, True), (1e-4, False)])
def test_a_store_calibration_turns_the_store_load_off_where_recompute_wins(
    run: Callable[..., Any], tmp_path: Path, setup_s: float, bypass: bool,
) -> None:
    """With a calibration via the KV connector's store, a continuation whose context is
    faster to recompute goes with kv_transfer_params.ftctl_load false; one faster to load
    goes as it is; nothing is exported either way, the output is unchanged."""
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({
        "worker": "a", "peer": "b", "model": MODEL, "layers": 2, "kv_heads": 2, "head_dim": 32,
        "dtype_bytes": 4, "block_size": 16, "via": "store",
        "prefill": {"fixed_s": 0.0, "per_token_s": 1e-3},
        "transfer": {"setup_s": setup_s, "bandwidth_bytes_per_s": 1e9},
    }))

    async def go() -> None:
        async with Cluster([FakeWorker(fail_after=7), FakeWorker()],
                           calibration=str(calibration)) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            _, events = await c.stream("/v1/completions", BODY)
            c.fleet.balancer.slots["w1"].outstanding = 0
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert c.workers[0].paths.count("/v1/completions") == 1
            continuation = c.workers[1].requests[-1]
            assert len(continuation["prompt"]) == 18
            if bypass:
                assert continuation["kv_transfer_params"] == {"ftctl_load": False}
            else:
                assert "kv_transfer_params" not in continuation
    run(go())
