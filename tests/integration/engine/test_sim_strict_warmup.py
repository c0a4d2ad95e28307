"""`ftctl sim serve` like real engines at the edges: strict request fields and a slow first request."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest
from tests import fetch

from dynamo_ftctl.loadgen.config import Length, Workload
from dynamo_ftctl.loadgen.workload import RequestFactory
from dynamo_ftctl.openai import chat_request, completion_request

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory

    from dynamo_ftctl.engine.launcher import SimWorker
    from dynamo_ftctl.http1 import Reply

pytestmark = pytest.mark.integration
MODEL = "ftctl-sim-tiny"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# Every field the sim accepts, at values that do not fail the request.
BOTH: dict[str, Any] = {
    "model": MODEL, "max_tokens": 3, "temperature": 0, "top_p": 1, "top_k": 0, "seed": 1,
    "stop": [], "stop_token_ids": [], "stream": False, "stream_options": None, "n": 1,
    "ignore_eos": True, "min_tokens": 2, "return_token_ids": True, "user": "u", "priority": 0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "min_p": 0,
}
FULL = {
    COMPLETIONS: {**BOTH, "prompt": "every field", "logprobs": 1, "echo": False},
    CHAT: {**BOTH, "messages": [{"role": "user", "content": "every field"}],
           "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2,
           "continue_final_message": False, "add_generation_prompt": True},
}


def post(worker: SimWorker, path: str, body: dict[str, Any]) -> Reply:
    """POST JSON to the worker with a bounded timeout."""
    return fetch.post(f"{worker.url}{path}", json=body, timeout=30)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_accepted_field_is_accepted(shared_sim_worker: SimWorker, path: str) -> None:
    """A request naming every field the sim knows is answered, min_tokens honoured."""
    response = post(shared_sim_worker, path, FULL[path])
    assert response.status == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_field_is_a_400_naming_it(shared_sim_worker: SimWorker, path: str) -> None:
    """An unknown field is refused with an OpenAI error whose param is that field."""
    response = post(shared_sim_worker, path, {**FULL[path], "frobnicate": 1, "zzz": 2})
    assert response.status == 400
    error = response.json()["error"]
    assert error["param"] == "frobnicate"
    assert error["type"] == "invalid_request_error"
    assert "'frobnicate'" in error["message"]
    assert "'zzz'" in error["message"]


def test_chat_only_field_on_completions_is_refused(shared_sim_worker: SimWorker) -> None:
    """`messages` fields do not slip through on /v1/completions (and vice versa)."""
    wrong = post(shared_sim_worker, COMPLETIONS, {**FULL[COMPLETIONS], "top_logprobs": 2})
    assert wrong.json()["error"]["param"] == "top_logprobs"
    wrong = post(shared_sim_worker, CHAT, {**FULL[CHAT], "echo": False})
    assert wrong.json()["error"]["param"] == "echo"


def test_unimplemented_penalty_is_refused(shared_sim_worker: SimWorker) -> None:
    """A penalty the sim cannot apply is a 400, not a silently different answer."""
    response = post(shared_sim_worker, COMPLETIONS, {**FULL[COMPLETIONS], "presence_penalty": 0.5})
    assert response.status == 400
    assert response.json()["error"]["param"] == "presence_penalty"


def test_our_own_clients_requests_are_accepted(shared_sim_worker: SimWorker) -> None:
    """Bodies built by ftctl's request builders and load generator pass strict validation."""
    bodies = [
        (COMPLETIONS, completion_request(MODEL, "x", max_tokens=2, temperature=0, top_p=1, seed=3,
                                         stop=["zz"], stream=True, return_token_ids=True,
                                         logprobs=1, extra={"ignore_eos": True})),
        (CHAT, chat_request(MODEL, [{"role": "user", "content": "x"}, {
            "role": "assistant", "content": "y"}], max_tokens=2, temperature=0, seed=3,
            return_token_ids=True, top_logprobs=1, continue_final_message=True)),
    ]
    for api in ("completions", "chat"):
        workload = Workload(api=api, prompt_tokens=Length.fixed(4), max_tokens=Length.fixed(2),
                            stream=True, ignore_eos=True, min_tokens=1)
        spec = RequestFactory(workload, (shared_sim_worker.url,), model=MODEL).build(0)
        bodies.append((CHAT if api == "chat" else COMPLETIONS, json.loads(spec.body)))
    for path, body in bodies:
        assert post(shared_sim_worker, path, body).status == 200, (path, body)


def post_escaped(worker: SimWorker, path: str, body: dict[str, Any]) -> Reply:
    """POST `body` as ASCII-escaped JSON: lone surrogates travel as `\\udXXX` escapes."""
    return fetch.post(f"{worker.url}{path}", content=json.dumps(body).encode(), timeout=30,
                      headers={"Content-Type": "application/json"})


# Lone surrogates wherever text reaches the tokenizer, and the field each 400 names.
UNENCODABLE = [
    (COMPLETIONS, {"prompt": "a\ud800"}, "prompt"),
    (COMPLETIONS, {"prompt": ["\udfff"]}, "prompt"),
    (COMPLETIONS, {"prompt": "ok", "stop": ["zz", "\udcff"]}, "stop"),
    (COMPLETIONS, {"prompt": "ok", "stop": "\ud800", "stream": True}, "stop"),
    (CHAT, {"messages": [{"role": "user", "content": "ok"},
                         {"role": "user", "content": "\udbff"}]}, "messages[1].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
            "stream": True}, "messages[0].content"),
]


@pytest.mark.parametrize(("path", "fields", "param"), UNENCODABLE)
def test_text_the_tokenizer_cannot_encode_is_a_400_naming_the_field(
    shared_sim_worker: SimWorker, path: str, fields: dict[str, Any], param: str,
) -> None:
    """A lone surrogate in any text the tokenizer sees is an OpenAI 400 naming the field,
    never a 500 (a proxy would take that for a failing worker: issue 22)."""
    response = post_escaped(shared_sim_worker, path, {"model": MODEL, "max_tokens": 2, **fields})
    assert response.status == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert "lone surrogate" in error["message"]


def test_byte_tokenizer_takes_escaped_bytes_and_refuses_other_surrogates(
    sim_worker_factory: SimWorkerFactory,
) -> None:
    """With --tokenizer byte, U+DC80-U+DCFF are bytes (a 200), U+D800 is a 400, not a 500."""
    worker = sim_worker_factory(name="bytes", args=["--tokenizer", "byte"])
    for path, fields, param in UNENCODABLE:
        escaped_byte = "\udcff" in json.dumps(fields, ensure_ascii=False)
        response = post_escaped(worker, path, {"model": MODEL, "max_tokens": 2, **fields})
        assert response.status == (200 if escaped_byte else 400), (fields, response.text)
        if not escaped_byte:
            assert response.json()["error"]["param"] == param
    assert "Traceback" not in worker.stderr_text()


def test_lenient_fields_ignores_unknown_fields(sim_worker_factory: SimWorkerFactory) -> None:
    """With --lenient-fields an unknown field is ignored, as before strict validation."""
    worker = sim_worker_factory(name="lenient", args=["--lenient-fields"])
    response = post(worker, COMPLETIONS, {**FULL[COMPLETIONS], "frobnicate": 1})
    assert response.status == 200


def test_first_request_waits_for_warm_up_while_health_answers(
    sim_worker_factory: SimWorkerFactory,
) -> None:
    """The first generation takes the warm-up delay more; /health answers 200 meanwhile."""
    warmup = 2.0
    worker = sim_worker_factory(name="warmup", warmup_s=warmup)
    body = completion_request(MODEL, "first", max_tokens=2, temperature=0)
    took: list[float] = []

    def first() -> None:
        start = time.monotonic()
        assert post(worker, COMPLETIONS, body).status == 200
        took.append(time.monotonic() - start)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        health = fetch.get(f"{worker.url}/health", timeout=warmup / 2)
        assert health.status == 200
        assert thread.is_alive(), "the first request finished before /health answered"
    finally:
        thread.join(timeout=60)
    assert took
    assert took[0] >= warmup
    start = time.monotonic()
    assert post(worker, COMPLETIONS, body).status == 200
    assert time.monotonic() - start < warmup  # warm now: no delay
