"""Cache-aware routing in front of two real vLLM servers (prefix caching on, vLLM's V1
default): each conversation of a multi-turn chat stays on one worker and its turns hit
that worker's prefix cache; new conversations spread over both workers.

Three conversations take turns through `ftctl proxy` with `routing: cache_aware` (three
over two workers: least-outstanding routing's round robin would move each from worker
to worker); each turn repeats the conversation so far (the assistant's real reply
included) and adds a user message. The proxy names the serving worker in
`x-ftctl-worker`; the servers' `vllm:prefix_cache_hits_total` and
`vllm:prefix_cache_queries_total` (tokens) are read before and after.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests import fetch
from tests.integration.proxy.test_proxy_sim import ProxyFactory, proxy_factory, wait_until
from tests.integration.vllm.server import VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["proxy_factory"]

TURNS = 4
_WORDS = ("the", "stream", "goes", "on", "from", "another", "worker", "with", "no", "token",
          "lost", "or", "repeated", "while", "cache", "keeps", "every", "block", "of",
          "prompt", "it", "has", "seen", "before")


def words(seed: int, count: int) -> str:
    """`count` words of a fixed list in an order fixed by `seed` (no randomness)."""
    return " ".join(_WORDS[(seed * 7 + i * 3) % len(_WORDS)] for i in range(count))


def prefix_counters(server: VllmServer) -> tuple[float, float]:
    """(hits, queries) in tokens, from the server's /metrics."""
    page = fetch.get(f"{server.url}/metrics", timeout=10).text
    found = {}
    for name in ("hits", "queries"):
        values = re.findall(rf"^vllm:prefix_cache_{name}_total(?:{{[^}}]*}})? (\S+)$", page,
                            re.MULTILINE)
        assert values, f"no vllm:prefix_cache_{name}_total on {server.name}"
        found[name] = sum(float(v) for v in values)
    return found["hits"], found["queries"]


def test_conversation_stays_on_one_worker_and_hits_its_prefix_cache(
        vllm_pair: tuple[VllmServer, ...], proxy_factory: ProxyFactory) -> None:
    """Every turn of a conversation is served by the worker of its first turn, both workers
    serve conversations, and later turns hit the prefix cache there."""
    model = vllm_pair[0].model
    proxy = proxy_factory([(s.name, s.url) for s in vllm_pair], model=model,
                          routing="cache_aware", breaker_threshold=100000)
    wait_until(lambda: fetch.get(f"{proxy.url}/health", timeout=5).status == 200, 30,
               "the proxy's health")
    before = {s.name: prefix_counters(s) for s in vllm_pair}
    chats: dict[str, list[dict[str, Any]]] = {
        c: [{"role": "system", "content": words(ord(c), 300)}] for c in "abc"}
    served: dict[str, list[str]] = {c: [] for c in chats}
    for turn in range(TURNS):
        for conv, messages in chats.items():
            messages.append({"role": "user", "content": words(turn + ord(conv), 30)})
            answer = fetch.post(f"{proxy.url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": messages, "max_tokens": 24,
                "temperature": 0.0, "ignore_eos": True})
            assert answer.status == 200, answer.text
            served[conv].append(answer.headers["x-ftctl-worker"])
            reply = answer.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
    assert all(len(set(workers)) == 1 for workers in served.values()), served
    assert {workers[0] for workers in served.values()} == {s.name for s in vllm_pair}, served
    for server in vllm_pair:
        hits0, queries0 = before[server.name]
        hits, queries = prefix_counters(server)
        # Turns 2..4 repeat all but their last user message: most of their tokens hit.
        assert hits - hits0 > 0.5 * (queries - queries0) * (TURNS - 1) / TURNS, (
            server.name, hits - hits0, queries - queries0)
