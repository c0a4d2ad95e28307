"""Streams from a real `ftctl sim` process: the server's own TTFT, clients that leave."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import pytest
from tests import fetch
from tests.waiting import wait_until

from dynamo_ftctl.engine.server import SERVER_TTFT_FIELD
from dynamo_ftctl.openai import completion_request, iter_sse_events

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration
MODEL = "ftctl-sim-tiny"


def _running(worker: SimWorker) -> float:
    text = fetch.get(f"{worker.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running in /metrics")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 12])
def test_finish_chunk_carries_the_server_ttft(shared_sim_worker: SimWorker, chat: bool,
                                              max_tokens: int) -> None:
    """Only the finishing chunk has ftctl_server_ttft_ms, > 0 and below the client's TTFT."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}}
        if chat else {**completion_request(MODEL, "x" * 64, max_tokens=max_tokens),
                      "ignore_eos": True, "stream": True, "return_token_ids": True})
    docs = []
    client_ttft = None
    start = time.monotonic()
    with fetch.stream("POST", f"{shared_sim_worker.url}{path}", json=body,
                      timeout=30) as response:
        assert response.status == 200
        for event in iter_sse_events(response.iter_bytes()):
            if event.is_done:
                break
            doc = json.loads(event.data)
            choices = doc["choices"]
            if client_ttft is None and choices and (choices[0].get("text")
                                                    or choices[0].get("delta", {}).get("content")
                                                    or choices[0].get("token_ids")):
                client_ttft = (time.monotonic() - start) * 1000
            docs.append(doc)
    with_field = [d for d in docs if SERVER_TTFT_FIELD in d]
    assert len(with_field) == 1
    final = with_field[0]
    assert final["choices"][0]["finish_reason"] == "length"
    assert client_ttft is not None
    assert 0 < final[SERVER_TTFT_FIELD] <= client_ttft
    tokens = sum(1 for d in docs if d["choices"] and d["choices"][0]["finish_reason"] is None
                 and "role" not in d["choices"][0].get("delta", {})) + 1
    assert tokens == max_tokens


def test_a_client_that_leaves_frees_its_request(sim_worker: SimWorker) -> None:
    """Closing a long stream after a few events aborts it: no request stays running."""
    body = {**completion_request(MODEL, "abc", max_tokens=1500), "ignore_eos": True,
            "stream": True}
    with fetch.stream("POST", f"{sim_worker.url}/v1/completions", json=body,
                      timeout=30) as response:
        for seen, _ in enumerate(iter_sse_events(response.iter_bytes()), start=1):
            if seen == 5:
                assert _running(sim_worker) == 1
                break
    wait_until(lambda: _running(sim_worker), 10, "the left stream's request ended",
               accept=lambda running: running == 0, interval=0.05)
