"""`ftctl sim serve` over real HTTP: OpenAI API, openai client streaming, continuation, errors."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest
from tests import fetch

from dynamo_ftctl.engine.tokenizer import load_tokenizer
from dynamo_ftctl.openai import (
    StreamAccumulator,
    chat_request,
    completion_request,
    iter_sse_events,
    parse_sse_event,
)

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker
    from dynamo_ftctl.http1 import Reply

pytestmark = pytest.mark.integration
MODEL = "ftctl-sim-tiny"


def post(worker: SimWorker, path: str, body: dict[str, Any], **kw: Any) -> Reply:
    """POST JSON to the worker with a bounded timeout."""
    return fetch.post(f"{worker.url}{path}", json=body, timeout=30, **kw)


def stream(worker: SimWorker, path: str, body: dict[str, Any],
           headers: dict[str, str] | None = None) -> StreamAccumulator:
    """Run a streaming request and fold its events."""
    acc = StreamAccumulator()
    with fetch.stream("POST", f"{worker.url}{path}", json=body, timeout=30,
                      headers=headers) as response:
        assert response.status == 200
        for event in iter_sse_events(response.iter_bytes()):
            acc.add(parse_sse_event(event))
    return acc


def test_models_health_and_metrics(shared_sim_worker: SimWorker) -> None:
    """/v1/models names the model with max_model_len; /health is 200; /metrics has vLLM names."""
    models = fetch.get(f"{shared_sim_worker.url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 2048
    assert fetch.get(f"{shared_sim_worker.url}/health", timeout=10).status == 200
    post(shared_sim_worker, "/v1/completions", completion_request(MODEL, "warm", max_tokens=2))
    text = fetch.get(f"{shared_sim_worker.url}/metrics", timeout=10).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket"):
        assert name in text


def test_stream_matches_non_stream_and_returns_ids(shared_sim_worker: SimWorker) -> None:
    """A stream's text, ids and logprobs equal the same request answered whole; ids header kept."""
    body = completion_request(MODEL, "Hello there", max_tokens=24, seed=5, temperature=0.7,
                              logprobs=3, return_token_ids=True)
    whole = post(shared_sim_worker, "/v1/completions", body,
                 headers={"X-Request-Id": "req-123"})
    assert whole.header("x-request-id") == "req-123"
    data = whole.json()
    assert data["id"] == "req-123"
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == load_tokenizer("bpe").encode("Hello there")
    acc = stream(shared_sim_worker, "/v1/completions", {**body, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    assert acc.token_ids == choice["token_ids"]
    assert acc.text == choice["text"]
    assert [lp.logprob for lp in acc.logprobs] == choice["logprobs"]["token_logprobs"]
    assert acc.finish_reason == "length"
    assert acc.usage is not None
    assert acc.usage.completion_tokens == 24


def test_official_openai_client_streams(shared_sim_worker: SimWorker) -> None:
    """The openai package streams completions and chat from the engine."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{shared_sim_worker.url}/v1", api_key="unused",
                           timeout=30, max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=10,
                                            temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks)
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0)
    assert text == whole.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        stream=True, logprobs=True, top_logprobs=2)
    pieces = list(chat)
    assert pieces[0].choices[0].delta.role == "assistant"
    assert pieces[-1].choices[0].finish_reason == "length"
    assert sum(len(p.choices[0].logprobs.content) for p in pieces if p.choices[0].logprobs) == 8
    client.close()


@pytest.mark.parametrize("chat", [False, True])
def test_http_continuation_at_random_cut_points(shared_sim_worker: SimWorker, chat: bool) -> None:
    """Over HTTP, prompt + first k ids gives the rest; chat text re-sent is another prompt."""
    tok = load_tokenizer("bpe")
    n = 32
    retokenized_differ = 0
    for temperature, seed in ((0.0, None), (0.9, 77)):
        if chat:
            messages = [{"role": "user", "content": "continue me"}]
            body = chat_request(MODEL, messages, max_tokens=n, temperature=temperature,
                                seed=seed, return_token_ids=True, extra={"ignore_eos": True})
            full = post(shared_sim_worker, "/v1/chat/completions", body).json()
        else:
            body = completion_request(MODEL, "continue me", max_tokens=n, temperature=temperature,
                                      seed=seed, return_token_ids=True, extra={"ignore_eos": True})
            full = post(shared_sim_worker, "/v1/completions", body).json()
        ids = full["choices"][0]["token_ids"]
        prompt_ids = (full if chat else full["choices"][0])["prompt_token_ids"]
        for k in random.Random(n).sample(range(1, n), 5):
            if chat:
                # What a client that re-sends text presents the model with (BPE: other ids).
                cont = chat_request(
                    MODEL, [*messages, {"role": "assistant", "content": tok.decode(ids[:k])}],
                    max_tokens=1, temperature=temperature, seed=seed, return_token_ids=True,
                    continue_final_message=True)
                via_text = post(shared_sim_worker, "/v1/chat/completions", cont).json()
                retokenized_differ += via_text["prompt_token_ids"] != prompt_ids + ids[:k]
            # Only the ids continue exactly (a chat too: its prompt ids as a completion).
            body = completion_request(MODEL, prompt_ids + ids[:k], max_tokens=n - k,
                                      temperature=temperature, seed=seed,
                                      return_token_ids=True, extra={"ignore_eos": True})
            got = post(shared_sim_worker, "/v1/completions", body).json()
            assert got["choices"][0]["token_ids"] == ids[k:], f"cut {k}"
    assert retokenized_differ > 0 or not chat


def test_errors_are_openai_shaped(shared_sim_worker: SimWorker) -> None:
    """Too long: 400 with an OpenAI error body; wrong model: 404; bad field: 400 naming it."""
    too_long = post(shared_sim_worker, "/v1/completions",
                    completion_request(MODEL, [42] * 2040, max_tokens=100))
    assert too_long.status == 400
    error = too_long.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "maximum context length is 2048" in error["message"]
    assert post(shared_sim_worker, "/v1/completions",
                completion_request("nope", "x")).status == 404
    bad = post(shared_sim_worker, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                      "max_tokens": -1})
    assert bad.status == 400
    assert bad.json()["error"]["param"] == "max_tokens"


def test_stop_strings_end_the_text(shared_sim_worker: SimWorker) -> None:
    """A stop string found in the output ends it there with finish_reason stop."""
    body = completion_request(MODEL, "stop test", max_tokens=40, temperature=0,
                              extra={"ignore_eos": True})
    text = post(shared_sim_worker, "/v1/completions", body).json()["choices"][0]["text"]
    stop = text[10:12]
    cut = post(shared_sim_worker, "/v1/completions", {**body, "stop": [stop]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    streamed = stream(shared_sim_worker, "/v1/completions", {**body, "stop": [stop],
                                                             "stream": True})
    assert streamed.text == text[: text.index(stop)]
    assert streamed.finish_reason == "stop"
