"""The proxy in front of `ftctl sim --dynamo` workers (no token ids, merged and empty chunks,
`nvext`, `event: token_ids`): exact counts and vendor extensions through it (issue 31)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import fetch
from tests.integration.proxy.test_proxy_sim import (
    MODEL,
    ProxyProcess,
    set_fault,
    spawn_proxy,
)

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration

TOKENIZER = Path(__file__).parents[3] / "src/dynamo_ftctl/engine/tokenizer.json"
# No bonus for ASCII tokens: the model then samples byte tokens that end inside a
# character, which Dynamo (and the sim) answer with an empty chunk, their text merged
# into the next one.
NO_ASCII_BIAS = "ascii_bias: 0.0\nlogit_scale: 1.0\n"
BODY = {"model": MODEL, "prompt": "héllo wörld, ünïcode ", "max_tokens": 120,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture
def dynamo_workers(sim_worker_factory: Any, tmp_path: Path) -> list[SimWorker]:
    """Two `--dynamo` sims with the same weights."""
    config = tmp_path / "no-ascii-bias.yaml"
    config.write_text(NO_ASCII_BIAS)
    return [sim_worker_factory(name=f"d{i}", model_config=str(config), args=("--dynamo",))
            for i in range(2)]


@pytest.fixture
def dynamo_proxy(dynamo_workers: list[SimWorker], tmp_path: Path) -> Iterator[ProxyProcess]:
    """`ftctl proxy` over the workers, each naming the sim's tokenizer; stopped at teardown."""
    inventory = {
        "cluster": "dynamo-test",
        "workers": [{"name": w.name, "url": w.url, "model": MODEL, "tokenizer": str(TOKENIZER)}
                    for w in dynamo_workers],
        "proxy": {"listen": "127.0.0.1:0", "scrape_interval_s": 0.1, "stall_timeout_s": 5.0},
    }
    proxy = spawn_proxy(inventory, tmp_path)
    try:
        yield proxy
    finally:
        proxy.stop()


def _stream(url: str, body: dict[str, Any], *, usage: bool = True,
            kill: Any = None) -> tuple[dict[str, str], bytes, list[dict[str, Any]]]:
    """Stream `body` from `url`; the headers, raw bytes and data chunks. `kill(headers, raw)`
    is called on each piece."""
    payload = {**body, "stream": True}
    if usage:
        payload["stream_options"] = {"include_usage": True}
    raw = b""
    with fetch.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as resp:
        assert resp.status == 200
        headers = resp.headers
        for piece in resp.iter_bytes():
            raw += piece
            if kill is not None:
                kill(headers, raw)
    chunks = [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
    return headers, raw, chunks


def _usage(chunks: list[dict[str, Any]]) -> dict[str, int] | None:
    found = [c["usage"] for c in chunks if not c["choices"] and c.get("usage")]
    return found[-1] if found else None


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_direct_dynamo_sim_merges_tokens_and_the_proxy_counts_them_exactly(
        dynamo_workers: list[SimWorker], dynamo_proxy: ProxyProcess) -> None:
    """Without a failure: fewer non-empty chunks than tokens, yet the client's usage is the
    worker's; nvext and `event: token_ids` arrive; no usage chunk unless asked."""
    _, raw, direct = _stream(dynamo_workers[0].url, BODY)
    direct_usage = _usage(direct)
    assert direct_usage is not None
    assert direct_usage["completion_tokens"] == BODY["max_tokens"]
    nonempty = sum(1 for c in direct if c["choices"] and c["choices"][0]["text"])
    assert nonempty < BODY["max_tokens"], "no merged tokens: the test proves nothing"
    assert raw.startswith(b"event: token_ids\n: [")

    headers, raw, got = _stream(dynamo_proxy.url, BODY)
    assert headers["x-ftctl-count"] == "usage"
    assert _usage(got) == direct_usage  # 0 tokens off, prompt included
    assert _text(got) == _text(direct)
    assert b"event: token_ids\n: [" in raw
    assert all("nvext" in c for c in got if c["choices"])

    _, _, quiet = _stream(dynamo_proxy.url, BODY, usage=False)
    assert _usage(quiet) is None  # asked upstream, not shown to a client that did not ask


def test_a_dynamo_worker_killed_mid_stream_costs_no_token_of_the_count(
        dynamo_workers: list[SimWorker], dynamo_proxy: ProxyProcess) -> None:
    """SIGKILL of the serving worker: the stream goes on from text, and completion_tokens
    and prompt_tokens are what a direct run reports (the cut attempt counted by the
    inventory's tokenizer, said in the final `x-ftctl-count` comment)."""
    _, _, direct = _stream(dynamo_workers[0].url, BODY)
    direct_usage = _usage(direct)
    assert direct_usage is not None
    for worker in dynamo_workers:
        set_fault(worker, {"kind": "slow", "delay_ms": 15})
    by_url = {w.name: w for w in dynamo_workers}
    killed: list[str] = []

    def kill(headers: dict[str, str], raw: bytes) -> None:
        if not killed and raw.count(b'"text":') >= 30:
            name = headers["x-ftctl-worker"].split(",")[-1]
            by_url[name].kill()
            killed.append(name)

    headers, raw, got = _stream(dynamo_proxy.url, BODY, kill=kill)
    assert killed, "the stream ended before the kill"
    assert b": x-ftctl-migrated: " in raw
    assert b'"error"' not in raw
    usage = _usage(got)
    assert usage is not None
    assert usage["completion_tokens"] == direct_usage["completion_tokens"]
    assert usage["prompt_tokens"] == direct_usage["prompt_tokens"]
    assert got[-1]["choices"] == [] or got[-1]["choices"][0]["finish_reason"] == "length"
    assert b": x-ftctl-count: tokenizer" in raw
    assert headers["x-ftctl-count"] == "usage"
    assert all("nvext" in c for c in got if c["choices"])


@pytest.mark.parametrize("cut", [False, True])
def test_a_load_run_through_the_proxy_counts_what_a_direct_run_counts(
        dynamo_workers: list[SimWorker], dynamo_proxy: ProxyProcess, cut: bool) -> None:
    """24 concurrent streams of different lengths through the proxy, fault-free or with the
    first worker dropping every stream after 20 tokens (each then migrated, from text):
    each request's completion_tokens equals the same request's direct count, 0 off, and
    the run's total with it."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{**BODY, "prompt": f"{BODY['prompt']}{i}", "max_tokens": 40 + i % 17}
              for i in range(24)]

    migrated: list[bool] = []

    def counts(url: str) -> list[int]:
        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(lambda b: _stream(url, b), bodies))
        out = []
        for _, raw, chunks in runs:
            usage = _usage(chunks)
            assert usage is not None
            out.append(usage["completion_tokens"])
            migrated.append(b": x-ftctl-migrated:" in raw)
        return out

    direct = counts(dynamo_workers[1].url)
    migrated.clear()
    if cut:
        set_fault(dynamo_workers[0], {"kind": "disconnect", "after_tokens": 20})
    through = counts(dynamo_proxy.url)
    print(f"\ncut={cut}: direct {sum(direct)} tokens, through the proxy {sum(through)}, "
          f"{sum(migrated)} of {len(bodies)} streams migrated")
    assert any(migrated) == cut
    assert through == direct
    assert sum(through) == sum(b["max_tokens"] for b in bodies)  # ignore_eos: every one
