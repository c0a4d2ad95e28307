"""ftctl against two real Hugging Face `transformers serve` servers (CPU, the tiny Llama): an
OpenAI-compatible server that returns no token ids and refuses every field it does not know.

What differs from vLLM, asserted in `test_engine_surface` so that a transformers upgrade that
changes it fails here: unknown fields (`return_token_ids`, `ignore_eos`, `min_tokens`,
`continue_final_message`, `add_generation_prompt`) are a 422 naming them; a token-id prompt
is a 400; no /metrics, /tokenize or /version; /v1/models lists the Hugging Face cache, not
the served model; X-Request-Id is taken as is (no UUID check) and echoed as the answer's id
and header; streams carry text only, one chunk per decoded piece (a piece may hold several
tokens), and end with a usage chunk whether asked or not.

So: `canary record` learns the refusal and records golden text (`return_token_ids: false`);
`ftctl load` sends nothing it refuses; the proxy continues a completion broken by a SIGKILL
from its prompt text + the text generated so far (`x-ftctl-continuation: text`). A chat is
continued through the model's own chat template: the text fallback's
`continue_final_message` is refused (422), so with the tokenizer directory named in the
inventory (`tokenizer:`) the proxy renders the conversation itself and continues on
/v1/completions, streaming chat chunks to the client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import fetch
from tests.integration.proxy.test_proxy_sim import (
    ProxyFactory,
    ProxyProcess,
    Streamed,
    migration_count,
    proxy_factory,
    stream,
)
from tests.integration.vllm.hf_server import spawn_hf_serve
from tests.integration.vllm.server import VllmServer, ftctl, inventory_for, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["proxy_factory"]  # the fixture, shared with the sim-worker tests

PROMPT = "Why must a stream survive the failure of the worker that serves it?"
MAX_TOKENS = 500  # ~1.3 s of decoding on one core: still running when the client sees CUT
CUT = 40
START_DEADLINE_S = 120.0  # one server is healthy and warm in 8-15 s on 2 busy cores


@pytest.fixture(scope="module")
def hf_servers(vllm_py: Path, tiny_llama: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, ...]]:
    """Two `transformers serve` servers for this module; stopped at its end."""
    logs = tmp_path_factory.mktemp("hf-serve")
    servers: list[VllmServer] = []
    try:
        began = time.monotonic()
        servers.extend(spawn_hf_serve(vllm_py, tiny_llama, logs / f"hf{i}.log", name=f"hf{i}")
                       for i in (1, 2))
        for server in servers:
            wait_healthy(server, began, START_DEADLINE_S)
        yield tuple(servers)
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def hf_pair(hf_servers: tuple[VllmServer, ...]) -> tuple[VllmServer, ...]:
    """The module's two servers, alive: one that an earlier test killed starts again."""
    for server in hf_servers:
        if not server.alive:
            server.restart()
    return hf_servers


def _body(endpoint: str, model: str) -> dict[str, Any]:
    """A greedy request with nothing this server refuses (no ignore_eos, no token ids)."""
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if endpoint == "/v1/completions":
        return body | {"prompt": PROMPT}
    return body | {"messages": [{"role": "user", "content": PROMPT}]}


def _pieces(server: VllmServer, endpoint: str, body: dict[str, Any]) -> list[str]:
    """The text pieces of a fault-free stream straight from `server`."""
    with fetch.stream("POST", server.url + endpoint, json={**body, "stream": True},
                      timeout=120) as reply:
        assert reply.status == 200, reply.read()
        raw = reply.read()
    pieces = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            choice = json.loads(line[6:])["choices"][0]
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            if piece:
                pieces.append(piece)
    return pieces


def _kill_after_pieces(count: int, by_name: dict[str, VllmServer]) -> tuple[Any, list[str]]:
    """A `stream` callback that SIGKILLs the serving server's group once the client saw
    `count` text pieces (a kill's reset drops what the proxy had not read: the cut is here)."""
    killed: list[str] = []

    def callback(out: Streamed, raw: bytes) -> None:
        if not killed and raw.count(b'"text":') + raw.count(b'"content":') >= count:
            name = out.headers["x-ftctl-worker"].split(",")[-1]
            by_name[name].kill()
            killed.append(name)

    return callback, killed


def _proxy_over(pair: tuple[VllmServer, ...], factory: ProxyFactory,
                tokenizer: Path | None = None) -> ProxyProcess:
    return factory([(s.name, s.url) for s in pair], model=pair[0].model,
                   worker_fields={"tokenizer": str(tokenizer)} if tokenizer else None,
                   breaker_threshold=100000, stall_timeout_s=5.0)


def test_engine_surface(hf_pair: tuple[VllmServer, ...]) -> None:
    """/health, /v1/models, /metrics, X-Request-Id, refused fields and a text-only stream."""
    server = hf_pair[0]
    url = server.url
    health = fetch.get(f"{url}/health", timeout=60)
    assert (health.status, health.json()) == (200, {"status": "ok"})
    assert fetch.get(f"{url}/v1/models", timeout=60).json() == {"object": "list", "data": []}
    for path in ("/metrics", "/tokenize", "/version"):
        assert fetch.get(url + path, timeout=60).status == 404, path
    base = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    reply = fetch.post(f"{url}/v1/completions", json=base, timeout=60,
                       headers={"X-Request-Id": "ftctl/trace 1"})
    assert reply.status == 200, reply.text
    assert reply.json()["id"] == reply.header("x-request-id") == "ftctl/trace 1"
    assert reply.json()["model"] == f"{server.model}@main"
    for field, value in (("return_token_ids", True), ("ignore_eos", True),
                         ("min_tokens", 1)):
        refused = fetch.post(f"{url}/v1/completions", json={**base, field: value}, timeout=60)
        assert refused.status == 422, (field, refused.text)
        assert field in refused.json()["detail"]
    assert fetch.post(f"{url}/v1/completions", json={**base, "prompt": [1, 2, 3]},
                      timeout=60).status == 400
    chat = {**_body("/v1/chat/completions", server.model), "max_tokens": 4,
            "continue_final_message": True, "add_generation_prompt": False}
    refused = fetch.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert refused.status == 422, refused.text
    with fetch.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**base, "stream": True, "max_tokens": 64}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith("data: {")]
    assert not any("token_ids" in c["choices"][0] for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 64  # sent without stream_options
    assert len(chunks) - 1 <= 64  # one chunk per decoded piece, not per token


def test_canary_record_then_probe_compares_text(hf_pair: tuple[VllmServer, ...],
                                                tmp_path: Path) -> None:
    """`canary record` learns that the server refuses return_token_ids and records golden text;
    `canary --all` with that set is healthy, and a changed golden text is a text mismatch."""
    inventory = inventory_for(tmp_path / "hf-serve-cpu.yaml", hf_pair)
    record = ftctl("-i", str(inventory), "canary", "record", "-w", hf_pair[0].name,
                    "-o", str(tmp_path / "canary-set.yaml"))
    assert record.returncode == 0, record.stdout + record.stderr
    recorded = yaml.safe_load((tmp_path / "canary-set.yaml").read_text())
    assert recorded["return_token_ids"] is False
    assert all(p["expected_text"] and "expected_token_ids" not in p
               for p in recorded["prompts"])
    probe = ftctl("-i", str(inventory), "canary", "--all", "--no-state", "--json")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert [w["verdict"] for w in json.loads(probe.stdout)["workers"]] == ["healthy"] * 2
    recorded["prompts"][0]["expected_text"] += "!"
    (tmp_path / "canary-set.yaml").write_text(yaml.safe_dump(recorded))
    wrong = ftctl("-i", str(inventory), "canary", "-w", hf_pair[1].name, "--no-state", "--json")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert json.loads(wrong.stdout)["workers"][0]["kind"] == "text_mismatch"


def test_load_on_both_workers(hf_pair: tuple[VllmServer, ...], tmp_path: Path) -> None:
    """`ftctl load` bounded by count and time over both workers: every request succeeds."""
    inventory = inventory_for(tmp_path / "hf-serve-cpu.yaml", hf_pair)
    done = ftctl("-i", str(inventory), "load", "--workers", ",".join(s.name for s in hf_pair),
                  "--rate", "4", "--requests", "16", "--duration", "60s", "--max-tokens", "16",
                  "--stream", "--timeout", "60s", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert (report["completed"], report["failed"], report["aborted"]) == (16, 0, None), report


def _assert_text_continuation(got: Streamed, expected: list[str], proxy: ProxyProcess) -> None:
    """Completed without error, announced as text, counted once with method="text"."""
    assert got.status == 200
    assert got.error is None, got.error + proxy.log_text()[-3000:]
    assert got.migrated == 1
    assert got.finish in ("length", "stop")
    assert got.headers.get("x-ftctl-continuation") == "text"
    assert migration_count(proxy, "text") == 1
    # Greedy: what the client saw before the cut is the fault-free run's; after it the
    # server continues from re-tokenized text, so the rest may differ.
    assert got.text.startswith("".join(expected[:CUT]))
    assert not got.ids  # no token ids reach the client from a server that has none


def test_sigkilled_completion_is_continued_from_text(hf_pair: tuple[VllmServer, ...],
                                                     proxy_factory: ProxyFactory) -> None:
    """SIGKILL of the serving server once the client saw CUT pieces: the proxy continues the
    completion on the other server from prompt text + generated text."""
    body = _body("/v1/completions", hf_pair[0].model)
    expected = _pieces(hf_pair[0], "/v1/completions", body)
    proxy = _proxy_over(hf_pair, proxy_factory)
    kill, killed = _kill_after_pieces(CUT, {s.name: s for s in hf_pair})
    got = stream(proxy, "/v1/completions", body, on_chunk=kill)
    assert killed, f"the stream ended before the kill: {got}\n{proxy.log_text()[-3000:]}"
    _assert_text_continuation(got, expected, proxy)


def test_sigkilled_chat_is_continued_from_text(hf_pair: tuple[VllmServer, ...],
                                               proxy_factory: ProxyFactory,
                                               tiny_llama: Path) -> None:
    """SIGKILL of the serving server mid-chat: this server refuses continue_final_message,
    so the proxy renders the conversation with the model's own chat template (the
    inventory's `tokenizer:` directory) and continues on /v1/completions from that text
    plus what was generated, still streaming chat chunks to the client."""
    body = _body("/v1/chat/completions", hf_pair[0].model)
    expected = _pieces(hf_pair[0], "/v1/chat/completions", body)
    proxy = _proxy_over(hf_pair, proxy_factory, tokenizer=tiny_llama)
    kill, killed = _kill_after_pieces(CUT, {s.name: s for s in hf_pair})
    got = stream(proxy, "/v1/chat/completions", body, on_chunk=kill)
    assert killed, f"the stream ended before the kill: {got}\n{proxy.log_text()[-3000:]}"
    _assert_text_continuation(got, expected, proxy)
