"""Streams broken mid-way on a real Dynamo 1.6.1 stack: Dynamo's own migration, and
`ftctl proxy` in front of two Dynamo frontends.

The fault comes from the client (client.py, in the namespace) once it has seen CUT tokens:
the mocker serving the stream is SIGKILLed or SIGSTOPped. Behind the proxy the serving
frontend is named by the proxy's x-ftctl-worker header (each frontend has one mocker);
behind one frontend with two mockers by the chunks' nvext.worker_id, which the stack maps to
a pid. The mocker decodes ~170 tokens/s, so MAX_TOKENS leaves seconds after the cut.

Dynamo's frontend takes no `return_token_ids` (a 400), so the proxy continues from text: its
token counts are approximate (docs/compatibility.md); what is asserted here is that the
stream completes, not an exact count.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.dynamo.conftest import StackFactory
from tests.integration.dynamo.stack import MODEL, Namespace, Stack
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 400
CUT = 40
STALL_S = 2.0


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Why must a stream survive the failure of its worker?",
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def cut_stream(ns: Namespace, url: str, request: dict[str, Any], sig: str,
               targets: dict[str, int], by: str) -> dict[str, Any]:
    return ns.client("stream", f"{url}/v1/completions", json.dumps(request),
                     "--act-at", str(CUT), "--signal", sig, "--targets", json.dumps(targets),
                     "--by", by, "--deadline", "30", timeout=120)


def two_frontends(stacks: StackFactory) -> tuple[Stack, Stack]:
    return stacks("a", 8001), stacks("b", 8002)


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_proxy_over_two_frontends_completes_a_stream_whose_mocker_fails(
        stacks: StackFactory, netns: Namespace, ns_proxy: Any, model_dir: Path,
        sig: str) -> None:
    """SIGKILL or SIGSTOP of the mocker behind the serving frontend: the client's stream
    through the proxy ends with finish_reason length, no error, one migration, and its
    usage counts every token asked for, 0 off (Dynamo sends no ids and no usage before
    the cut: the proxy counts the cut attempt's text with the inventory's tokenizer)."""
    a, b = two_frontends(stacks)
    _, url = ns_proxy([("fe1", a.url), ("fe2", b.url)], stall_timeout_s=STALL_S,
                      breaker_threshold=100000, tokenizer=model_dir)
    got = cut_stream(netns, url, body(), sig,
                     {"fe1": a.mockers[0].pid, "fe2": b.mockers[0].pid}, "header")
    assert got["acted_on"] in {"fe1", "fe2"}, got
    assert got["status"] == 200, got
    assert got["error"] is None, got
    assert got["finish"] == "length", got
    assert got["done"], got
    assert got["migrated"] == 1, got
    assert got["headers"].get("x-ftctl-continuation") == "text", got
    # Text mode counts a chunk a token; the mocker sends one token a chunk.
    assert got["tokens"] >= CUT, got
    assert got["usage"]["completion_tokens"] == MAX_TOKENS, got
    if sig == "STOP":
        assert got["stall_after_act_s"] >= STALL_S * 0.9, got


def test_workerless_frontend_is_judged_absent_not_relayed(
        stacks: StackFactory, netns: Namespace, ns_proxy: Any) -> None:
    """A frontend whose only mocker was SIGKILLed answers 404 with an empty body once its
    discovery entry expires: the proxy takes it out of routing for the model and the 404 is
    never relayed. One request may meet it (x-ftctl-worker `fe2,fe1`: the proxy
    learnt from that 404 and sent the request on); none after it does."""
    a, b = two_frontends(stacks)
    b.mockers[0].signal(signal.SIGKILL)
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    seen: list[tuple[int, str]] = []

    def answer() -> tuple[int, str]:
        # A POST inside the namespace: 503 "not ready" until the entry expires (~10 s).
        doc = netns.client("post", f"{b.url}/v1/completions", json.dumps(request))
        seen.append((doc["status"], doc["body"][:80]))
        return seen[-1]

    wait_until(answer, 60.0, "the workerless frontend's 404", accept=lambda a: a[0] == 404)
    assert seen[-1] == (404, ""), seen[-3:]
    proxy, url = ns_proxy([("fe1", a.url), ("fe2", b.url)], stall_timeout_s=STALL_S)
    served = [netns.client("post", f"{url}/v1/completions", json.dumps(request))
              for _ in range(6)]
    assert [d["status"] for d in served] == [200] * 6, served
    routes = [d["headers"].get("x-ftctl-worker") for d in served]
    assert [r for r in routes if r != "fe1"] in ([], ["fe2,fe1"]), routes
    assert "fe2 out of routing for tiny-llama: HTTP 404" in proxy.log_text()


def test_dynamos_own_migration_completes_a_stream_whose_mocker_is_killed(
        stacks: StackFactory, netns: Namespace) -> None:
    """One frontend (--migration-limit 3), two mockers; SIGKILL of the serving one: the
    stream completes on the other, every token there (Dynamo continues from token ids)."""
    stack = stacks("a", 8001, mockers=2)
    got = cut_stream(netns, stack.url, body(nvext={"extra_fields": ["worker_id"]}), "KILL",
                     stack.instances, "nvext")
    assert got["acted_on"] in stack.instances, got
    assert got["status"] == 200, got
    assert got["error"] is None, got
    assert got["finish"] == "length", got
    assert got["usage"]["completion_tokens"] == MAX_TOKENS, got
    # Chunks with text: a token that ends inside a UTF-8 character comes out with the next
    # (the mocker's tokens are random bytes); one run of several counted 399 of 400.
    assert MAX_TOKENS - 5 <= got["tokens"] <= MAX_TOKENS, got
