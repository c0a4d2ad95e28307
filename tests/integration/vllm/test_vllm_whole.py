"""Whole upstream answers (`proxy.whole_max_tokens`) on real vLLM: the proxy asks vLLM for
one non-streamed answer, and the client's document is vLLM's own (text, finish reason,
usage, ids), stop strings matched by vLLM itself."""

from __future__ import annotations

from typing import Any

import pytest

from tests import fetch
from tests.integration.proxy.test_proxy_sim import ProxyFactory, proxy_factory
from tests.integration.vllm.server import VllmServer
from tests.integration.vllm.test_vllm_proxy import PROMPT, proxy_over

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["proxy_factory"]  # the fixture


def _body(endpoint: str, model: str, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": 24, "temperature": 0.0,
                            "stream": False, **more}
    if endpoint == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    return body


def _choice_text(doc: dict[str, Any]) -> str:
    choice = doc["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("more", [{}, {"return_token_ids": True}, {"stop": ["e"]}],
                         ids=["plain", "ids", "stop"])
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"],
                         ids=["chat", "completions"])
def test_a_whole_answer_is_vllms_own(vllm_pair: tuple[VllmServer, ...],
                                     proxy_factory: ProxyFactory, endpoint: str,
                                     more: dict[str, Any]) -> None:
    """A greedy non-streamed request through the proxy (whole answers on) reads as the
    same request sent straight to vLLM, and the proxy's Prometheus series count it."""
    server = vllm_pair[0]
    body = _body(endpoint, server.model, **more)
    direct = fetch.post(server.url + endpoint, json=body, timeout=120)
    assert direct.status == 200, direct.body
    proxy = proxy_over([(server.name, server.url)], server.model, proxy_factory,
                       whole_max_tokens=64)
    got = fetch.post(proxy.url + endpoint, json=body, timeout=120)
    assert got.status == 200, got.body
    mine, theirs = got.json(), direct.json()
    assert _choice_text(mine) == _choice_text(theirs)
    assert mine["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    assert mine["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    if more.get("return_token_ids"):
        assert mine["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
    if "stop" in more:
        assert mine["choices"][0]["finish_reason"] == "stop"
        assert "e" not in _choice_text(mine)
    assert got.headers["x-ftctl-worker"] == server.name
    assert got.headers["x-ftctl-count"] in {"ids", "usage"}
