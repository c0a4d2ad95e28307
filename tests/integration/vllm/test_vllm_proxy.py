"""`ftctl proxy` in front of two real vLLM servers: a broken stream goes on token by token.

Each case streams through the proxy and breaks the serving worker once CUT tokens of
its answer are on their way to the client. A chat continues as a completion of its
rendered prompt's ids + the generated ids (vLLM re-tokenizes text into other ids, so a
text continuation would differ from the cut on).

- Greedy: the client's ids and text equal the fault-free run straight from a worker.
- Seeded (T=0.9, seed 7): vLLM's V1 sampler draws each step's noise from a per-request
  generator seeded once (v1/sample/ops/topk_topp_sampler.py, `forward_cpu`), so no
  continuation can repeat the uninterrupted run after the cut (docs/compatibility.md).
  What must hold: the ids before the cut are the fault-free run's, and the ids after it
  are exactly what vLLM gives for that context and seed: nothing lost, repeated or
  re-tokenized.

The fault, once CUT tokens have passed: the serving server's connection is reset in a
fault proxy (`faults.netproxy`) between it and the proxy, and its process group is
SIGKILLed. A kill alone does not cut the stream: the tiny model decodes ~1000 tokens/s,
the dying server's socket still delivers all it wrote, and a client starved by the two
spinning engines was still at token 40 when the whole answer had been written (CI,
twice). The fault proxy paces each answer to PACE_KIB_S, so what the server wrote ahead
waits there and the reset drops it. The fault proxy itself counts the tokens and acts
before it passes the next piece: a count made by the client can come after the relay
has passed the whole answer (the client's socket and reader hold what the relay
passed, unpaced, while the client is starved). The `vllm_pair` fixture starts a killed
server again for the next test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dynamo_ftctl.faults.netproxy import NetProxy, Toxic
from tests import fetch
from tests.integration.proxy.test_proxy_sim import (
    ProxyFactory,
    ProxyProcess,
    Streamed,
    proxy_factory,
    stream,
    wait_until,
)
from tests.integration.vllm.server import VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

__all__ = ["proxy_factory"]  # the fixture, shared with the sim-worker tests

# Longer than what a paced fault proxy may still deliver after the kill (one 64 KiB read).
MAX_TOKENS = 1000
PACE_KIB_S = 64.0  # ~150 streamed tokens/s with their ids
CUT = 40
STALL_S = 5.0
PROMPT = "Why must a stream survive the failure of the worker that serves it?"


def body_of(endpoint: str, seeded: bool, model: str,
            max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """A request that asks for token ids, greedy or seeded (T=0.9, seed 7)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "return_token_ids": True,
                            "ignore_eos": True}
    body |= {"temperature": 0.9, "top_p": 0.95, "seed": 7} if seeded else {"temperature": 0.0}
    if endpoint == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    return body


@dataclass(frozen=True)
class Run:
    """One fault-free stream straight from a server."""

    prompt_ids: list[int]
    ids: list[int]
    text: str


def direct(server: VllmServer, endpoint: str, body: dict[str, Any]) -> Run:
    """Stream `body` straight from `server` and collect its prompt ids, ids and text."""
    with fetch.stream("POST", server.url + endpoint, json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status == 200, resp.read()
        raw = b"".join(resp.iter_bytes())
    prompt: list[int] = []
    ids: list[int] = []
    text = ""
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        doc = json.loads(line[6:])
        prompt = prompt or doc.get("prompt_token_ids") or []
        for choice in doc["choices"]:
            prompt = prompt or choice.get("prompt_token_ids") or []
            ids.extend(choice.get("token_ids") or [])
            delta = choice.get("delta")
            text += (delta.get("content") or "") if delta is not None else choice["text"]
    return Run(prompt, ids, text)


# A token id list in vLLM's streamed JSON ("token_ids" only: not "prompt_token_ids").
_TOKEN_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')


class TokenCount:
    """The token ids of each answer a relay passes, counted per connection from its SSE
    events (ids, not events: a vLLM API server that falls behind its engine sends the
    tokens made meanwhile in one event; 40 events held all of 1800 tokens once)."""

    def __init__(self) -> None:
        self.seen: dict[object, tuple[bytes, int]] = {}  # unfinished line, ids counted

    def add(self, conn: object, piece: bytes) -> int:
        """Count `piece` of `conn`'s answers; the ids they have passed so far."""
        tail, ids = self.seen.get(conn, (b"", 0))
        tail += piece
        end = tail.rfind(b"\n") + 1  # whole lines only (an event's data is one line)
        ids += sum(len(m.group(1).split(b",")) for m in _TOKEN_IDS.finditer(tail, 0, end)
                   if m.group(1).strip())
        self.seen[conn] = (tail[end:], ids)
        return ids


@dataclass
class Relays:
    """The fault proxies in front of the pair, on a loop of their own thread."""

    workers: list[tuple[str, str]]  # (name, the URL of its fault proxy)
    relays: dict[str, NetProxy]  # by worker name

    def cut_after(self, count: int, then: Callable[[str], None] | None = None) -> list[str]:
        """Once one relay has passed `count` token ids of an answer, reset its connections
        and call `then(worker)`, on the relays' loop before it passes more; the list gets
        the worker's name (empty: the answers ended first)."""
        hit: list[str] = []

        def arm(name: str, relay: NetProxy) -> None:
            counted = TokenCount()

            def watch(conn: object, piece: bytes) -> None:
                if not hit and counted.add(conn, piece) >= count:
                    hit.append(name)
                    relay.add_toxic(Toxic(name="cut", kind="reset_peer", timeout_ms=0.0))
                    if then is not None:
                        then(name)

            relay.on_downstream = watch

        for name, relay in self.relays.items():
            arm(name, relay)
        return hit


@contextlib.contextmanager
def paced(pair: tuple[VllmServer, ...]) -> Iterator[Relays]:
    """A fault proxy in front of each server, pacing its answers to PACE_KIB_S."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def start(server: VllmServer) -> NetProxy:
        relay = await NetProxy("127.0.0.1", int(server.url.rsplit(":", 1)[1])).start()
        relay.add_toxic(Toxic(name="pace", kind="bandwidth", rate_kbps=PACE_KIB_S))
        return relay

    relays: list[NetProxy] = []
    try:
        relays = [call(start(server)) for server in pair]
        by_name = {s.name: r for s, r in zip(pair, relays, strict=True)}
        yield Relays([(name, f"http://127.0.0.1:{r.port}") for name, r in by_name.items()],
                     by_name)
    finally:
        for relay in relays:
            call(relay.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def proxy_over(workers: list[tuple[str, str]], model: str,
               factory: ProxyFactory, **settings: Any) -> ProxyProcess:
    """The proxy over `workers` (name, URL), once it has learnt their max_model_len;
    `settings` are more `proxy:` settings."""
    proxy = factory(workers, model=model, breaker_threshold=100000, stall_timeout_s=STALL_S,
                    **settings)

    def knows() -> bool:
        doc = fetch.get(f"{proxy.url}/v1/models", timeout=5).json()
        return all("max_model_len" in entry for entry in doc["data"])

    wait_until(knows, 30, "the proxy's first scrape of the vLLM servers")
    return proxy


def cut_point(proxy: ProxyProcess) -> int:
    """How many tokens the client had when the worker failed (the proxy's log says)."""
    found = re.findall(r"worker failed: .*\(after (\d+) tokens\)", proxy.log_text())
    assert len(found) == 1, proxy.log_text()
    return int(found[0])


def assert_continued(got: Streamed, expected: Run, proxy: ProxyProcess,
                     survivor: VllmServer, body: dict[str, Any], *, seeded: bool) -> None:
    """Greedy: the fault-free run. Seeded: its prefix, then vLLM's own continuation."""
    assert got.error is None, got.error
    assert got.migrated == 1
    assert got.finish == "length"
    length = body["max_tokens"]
    assert got.usage is not None
    assert got.usage["completion_tokens"] == length
    assert "x-ftctl-continuation" not in got.headers  # token ids, not text
    if not seeded:
        first = next((i for i, (a, b) in enumerate(zip(got.ids, expected.ids, strict=False))
                      if a != b), None)
        assert got.ids == expected.ids, f"ids differ from token {first} on"
        assert got.text == expected.text
        return
    cut = cut_point(proxy)
    assert CUT <= cut < length
    assert got.ids[:cut] == expected.ids[:cut]
    rest = direct(survivor, "/v1/completions", {
        **{k: v for k, v in body.items() if k != "messages"},
        "prompt": expected.prompt_ids + got.ids[:cut], "max_tokens": length - cut})
    assert got.ids[cut:] == rest.ids
    assert len(got.ids) == length


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"],
                         ids=["chat", "completions"])
def test_sigkilled_worker_mid_stream_is_continued_from_token_ids(
    vllm_pair: tuple[VllmServer, ...], proxy_factory: ProxyFactory, endpoint: str,
    seeded: bool,
) -> None:
    """SIGKILL of the serving vLLM once CUT tokens passed: the stream goes on from its ids
    on the other server (the next test gets the killed one back)."""
    by_name = {s.name: s for s in vllm_pair}
    body = body_of(endpoint, seeded, vllm_pair[0].model)
    expected = direct(vllm_pair[0], endpoint, body)
    with paced(vllm_pair) as relays:
        killed = relays.cut_after(CUT, lambda name: by_name[name].kill())
        proxy = proxy_over(relays.workers, vllm_pair[0].model, proxy_factory)
        got = stream(proxy, endpoint, body)
    assert killed, "the stream ended before the kill"
    survivor = next(s for s in vllm_pair if s.name != killed[0])
    assert_continued(got, expected, proxy, survivor, body, seeded=seeded)
