"""ftctl against two real vLLM servers (CPU, tiny random-weight Llama), and the vLLM facts the
migrating proxy relies on, asserted so that a vLLM upgrade that breaks one fails here.

The proxy resumes an interrupted stream on another worker by sending the prompt's token ids
plus the ids generated so far as a token-id prompt; that is exact only if the engine reports
ids (`return_token_ids`) and greedy decoding continues the same way from ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import fetch
from tests.integration.vllm.server import VllmServer, ftctl, inventory_for, pinned_version

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.timeout(900),  # two servers start in 1-3 min on 2 shared cores
]

PROMPT = "The capital of France is"
LENGTH = 150
SPLITS = (30, 59, 120)
TIMEOUT_S = 120.0  # long enough for 150 tokens on a busy core


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with stream=true; return the parsed SSE chunks (without [DONE])."""
    chunks = []
    with fetch.stream("POST", url, json={**body, "stream": True}, timeout=TIMEOUT_S) as reply:
        assert reply.status == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def _complete(server: VllmServer, prompt: str | list[int], max_tokens: int,
              **sampling: Any) -> tuple[list[int], list[int]]:
    """A non-streamed completion: (prompt ids, generated ids)."""
    reply = fetch.post(server.url + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens,
        "ignore_eos": True, "return_token_ids": True, "temperature": 0.0, **sampling})
    assert reply.status == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def test_canary_record_then_probe_both(vllm_pair: tuple[VllmServer, ...], tmp_path: Path) -> None:
    """`canary record` on a freshly started vLLM (its first request is slow: record warms it
    up first), then `canary --all` with that set exits 0."""
    vllm_pair[0].restart(warm=False)
    inventory = inventory_for(tmp_path / "vllm-cpu.yaml", vllm_pair)
    record = ftctl("-i", str(inventory), "canary", "record", "-w", vllm_pair[0].name,
                    "-o", str(tmp_path / "canary-set.yaml"))
    assert record.returncode == 0, record.stdout + record.stderr
    recorded = yaml.safe_load((tmp_path / "canary-set.yaml").read_text())
    assert recorded["model"] == vllm_pair[0].model
    assert all(p["expected_token_ids"] for p in recorded["prompts"])
    probe = ftctl("-i", str(inventory), "canary", "--all", "--no-state", "--json")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    json.loads(probe.stdout)


def test_load_on_both_workers(vllm_pair: tuple[VllmServer, ...], tmp_path: Path) -> None:
    """`ftctl load` bounded by count and time over both workers: every request succeeds."""
    inventory = inventory_for(tmp_path / "vllm-cpu.yaml", vllm_pair)
    done = ftctl("-i", str(inventory), "load", "--workers", ",".join(s.name for s in vllm_pair),
                  "--rate", "4", "--requests", "16", "--duration", "60s", "--max-tokens", "16",
                  "--stream", "--timeout", "60s", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == "ftctl-load-report"
    assert (report["completed"], report["failed"], report["aborted"]) == (16, 0, None), report
    assert report["model"] == vllm_pair[0].model


def test_streams_carry_token_ids(vllm_pair: tuple[VllmServer, ...]) -> None:
    """Streamed completions and chat with return_token_ids carry prompt and per-chunk ids."""
    server = vllm_pair[0]
    body = {"model": server.model, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    chunks = _stream(server.url + "/v1/completions", {**body, "prompt": PROMPT})
    # Completions: prompt ids inside choices[0] of the first chunk, null afterwards.
    assert chunks[0]["choices"][0]["prompt_token_ids"]
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 8
    chat = _stream(server.url + "/v1/chat/completions",
                   {**body, "messages": [{"role": "user", "content": PROMPT}]})
    # Chat: prompt ids at the TOP level of the first chunk (a role-only chunk, no token_ids).
    assert chat[0]["prompt_token_ids"]
    assert "prompt_token_ids" not in chat[0]["choices"][0]
    assert chat[0]["choices"][0]["delta"].get("role") == "assistant"
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in chat) == 8
    assert all(c["choices"][0]["token_ids"] for c in chat[1:])


@pytest.mark.parametrize("k", SPLITS)
def test_greedy_continuation_from_ids_is_exact(vllm_pair: tuple[VllmServer, ...],
                                               k: int) -> None:
    """Greedy: prompt ids + first k generated ids, on the other worker, give the rest exactly."""
    first, second = vllm_pair
    prompt_ids, generated = _complete(first, PROMPT, LENGTH)
    assert len(generated) == LENGTH
    _, rest = _complete(second, prompt_ids + generated[:k], LENGTH - k)
    assert rest == generated[k:]


def test_chat_continues_as_completion_from_ids(vllm_pair: tuple[VllmServer, ...]) -> None:
    """A chat stream's prompt ids + its first ids, sent to /v1/completions, continue it exactly."""
    first, second = vllm_pair
    chat = _stream(first.url + "/v1/chat/completions", {
        "model": first.model, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": LENGTH, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    prompt_ids = chat[0]["prompt_token_ids"]
    generated = [i for c in chat for i in c["choices"][0].get("token_ids") or []]
    assert len(generated) == LENGTH
    _, rest = _complete(second, prompt_ids + generated[:59], LENGTH - 59)
    assert rest == generated[59:]


def test_retokenized_text_gives_other_ids(vllm_pair: tuple[VllmServer, ...]) -> None:
    """Re-tokenizing generated text does not give the generated ids back (why ids travel)."""
    server = vllm_pair[0]
    reply = fetch.post(server.url + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": server.model, "prompt": PROMPT, "max_tokens": LENGTH, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    choice = reply.json()["choices"][0]
    tokenized = fetch.post(server.url + "/tokenize", timeout=TIMEOUT_S, json={
        "model": server.model, "prompt": choice["text"], "add_special_tokens": False}).json()
    assert tokenized["tokens"] != choice["token_ids"]


def test_seeded_continuation_is_not_exact(vllm_pair: tuple[VllmServer, ...]) -> None:
    """Seeded sampling repeats an uninterrupted run on any worker, but not from a split point.

    vLLM seeds a request's torch.Generator once from `seed` and draws from it once per sampled
    token (v1/worker/gpu_model_runner.py, v1/sample/ops/topk_topp_sampler.py forward_cpu), so a
    continuation replays the noise of positions 1, 2, ... at positions k+1, k+2, ...
    """
    first, second = vllm_pair
    seeded = {"temperature": 0.9, "seed": 7}
    prompt_ids, generated = _complete(first, PROMPT, LENGTH, **seeded)
    assert _complete(second, PROMPT, LENGTH, **seeded)[1] == generated
    _, greedy = _complete(first, PROMPT, LENGTH)
    assert generated != greedy, "temperature 0.9 sampled the greedy answer: the test proves nothing"
    for k in SPLITS:
        _, rest = _complete(second, prompt_ids + generated[:k], LENGTH - k, **seeded)
        assert rest != generated[k:], f"seeded continuation at k={k} was exact"


def test_engine_surface(vllm_pair: tuple[VllmServer, ...]) -> None:
    """/health, /v1/models, /version, /metrics, X-Request-Id and unknown fields, as ftctl sees."""
    server = vllm_pair[0]
    health = fetch.get(server.url + "/health", timeout=TIMEOUT_S)
    assert (health.status, health.body) == (200, b"")
    (model,) = fetch.get(server.url + "/v1/models", timeout=TIMEOUT_S).json()["data"]
    assert (model["id"], model["max_model_len"]) == (server.model, 2048)
    version = fetch.get(server.url + "/version", timeout=TIMEOUT_S).json()
    assert version == {"version": pinned_version()}
    metrics = fetch.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                 "vllm:num_requests_running", "vllm:generation_tokens_total"):
        assert f"\n{name}{{" in metrics, name
    # A request id that is not a UUID is taken as is (vLLM prefixes it), not echoed as a header.
    reply = fetch.post(server.url + "/v1/completions", headers={"X-Request-Id": "ftctl/trace 1"},
                       timeout=TIMEOUT_S,
                       json={"model": server.model, "prompt": PROMPT, "max_tokens": 2,
                             "ftctl_unknown_field": True})
    assert reply.status == 200, reply.text  # unknown fields: ignored (logged at DEBUG)
    assert reply.json()["id"] == "cmpl-ftctl/trace 1"
    assert "x-request-id" not in reply.headers
