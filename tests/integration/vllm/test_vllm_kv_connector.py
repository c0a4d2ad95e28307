"""ftctl's KV connector in two real vLLM servers sharing a store, `ftctl proxy` in front.

The pair here runs `dynamo_ftctl.vllm_connector.FtctlConnector` on one temporary store,
with `--enable-prompt-tokens-details` (the proxy reads `cached_tokens`) and
`--max-num-batched-tokens 256`: the ~600-token prompt is prefilled in chunks, so blocks
are saved chunk by chunk and a continuation loads more than one chunk's worth. Before
it starts, the session's plain pair (if any) is stopped: two servers at once at most.

- A stream cut by SIGKILL at a random token (after the pacing fault proxy's reset, as in
  test_vllm_proxy.py) goes on on the other server token-exact against an uncut run, and
  the proxy reports that server loaded all but at most one block plus the tokens past
  the last full block of the continued prompt.
- A block damaged in the store (bytes flipped) is a miss: the continuation loads the
  blocks before it, computes the rest, and its output is still exact.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dynamo_ftctl.kv.blockstore import BlockStore
from tests.integration.proxy.test_proxy_sim import ProxyFactory, proxy_factory, stream
from tests.integration.vllm import conftest
from tests.integration.vllm.server import VllmServer, spawn_vllm, wait_healthy
from tests.integration.vllm.test_vllm_proxy import (
    after_tokens,
    direct,
    paced,
    proxy_over,
    signal_group,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

__all__ = ["proxy_factory"]  # the fixture, shared with the sim-worker tests

BLOCK = 128  # vLLM's CPU block size (the servers' log says "blocks on dim 0")
BATCH_TOKENS = 256  # --max-num-batched-tokens: a longer prompt is a chunked prefill
MAX_TOKENS = 300
README = Path(__file__).resolve().parents[3] / "README.md"


def long_prompt() -> str:
    """~600 tokens of the README (the tiny model's corpus): more than two chunks."""
    return README.read_text()[:2400]


def body_for(endpoint: str, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                            "return_token_ids": True, "ignore_eos": True}
    if endpoint == "/v1/completions":
        body["prompt"] = long_prompt()
    else:
        body["messages"] = [{"role": "user", "content": long_prompt()}]
    return body


@pytest.fixture(scope="module")
def kv_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvstore")


@pytest.fixture(scope="module")
def kv_servers(vllm_py: Path, tiny_llama: Path, kv_store: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, ...]]:
    """Two servers with the connector on `kv_store`, one core each; stopped at the end."""
    for server in conftest.SESSION_SERVERS:
        server.stop()
    config = json.dumps({
        "kv_connector": "FtctlConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "dynamo_ftctl.vllm_connector",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": str(kv_store), "budget_bytes": 1 << 30}})
    args = ("--kv-transfer-config", config, "--enable-prompt-tokens-details",
            "--max-num-batched-tokens", str(BATCH_TOKENS), "--max-model-len", "2048")
    logs = tmp_path_factory.mktemp("vllm-kv")
    cpus = sorted(os.sched_getaffinity(0))
    servers: list[VllmServer] = []
    try:
        began = time.monotonic()
        for index in range(2):
            name = f"kv{index + 1}"
            servers.append(spawn_vllm(vllm_py, tiny_llama, logs / f"{name}.log", name=name,
                                      cpu=cpus[index % len(cpus)], extra_args=args))
        for server in servers:
            wait_healthy(server, began)
        yield tuple(servers)
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def kv_pair(kv_servers: tuple[VllmServer, ...]) -> tuple[VllmServer, ...]:
    """The module's servers, alive (one an earlier test killed starts again)."""
    for server in kv_servers:
        if not server.alive:
            server.restart()
    return kv_servers


def prompt_tokens_counted(proxy_url: str) -> dict[tuple[str, str], float]:
    """ftctl_migration_prompt_tokens_total by (method, kind)."""
    found = {}
    for line in httpx.get(f"{proxy_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("ftctl_migration_prompt_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            method = labels.split('method="')[1].split('"')[0]
            kind = labels.split('kind="')[1].split('"')[0]
            found[method, kind] = float(value)
    return found


def completion(server: VllmServer, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy ids and cached prompt tokens of a non-streamed completion from `server`."""
    resp = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "return_token_ids": True, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    return doc["choices"][0]["token_ids"], doc["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"],
                         ids=["chat", "completions"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_cut_stream_goes_on_from_the_stored_kv(
    kv_pair: tuple[VllmServer, ...], proxy_factory: ProxyFactory, endpoint: str, seed: int,
) -> None:
    """SIGKILL at a random token: the other server continues token-exact, loading all but
    at most one block plus the tail past the continued prompt's last full block."""
    by_name = {s.name: s for s in kv_pair}
    body = body_for(endpoint, kv_pair[0].model)
    expected = direct(kv_pair[0], endpoint, body)
    assert len(expected.prompt_ids) > BATCH_TOKENS  # a chunked prefill
    cut = random.Random(f"{endpoint}{seed}").randrange(40, MAX_TOKENS - 80)
    with paced(kv_pair) as relays:

        def kill(name: str) -> None:
            relays.cut(name)
            signal_group(by_name[name], signal.SIGKILL)

        kill_at_cut, killed = after_tokens(cut, kill)
        proxy = proxy_over(relays.workers, kv_pair[0].model, proxy_factory)
        got = stream(proxy, endpoint, body, on_chunk=kill_at_cut)
        counted = prompt_tokens_counted(proxy.url)
    assert killed, "the stream ended before the kill"
    assert got.error is None, got.error
    assert got.migrated == 1
    assert got.ids == expected.ids
    assert got.text == expected.text
    loaded, recomputed = counted.get(("kv", "loaded"), 0), counted.get(("kv", "recomputed"), 0)
    continued = int(loaded + recomputed)
    assert continued > len(expected.prompt_ids), counted  # the prompt and the cut's ids
    assert recomputed <= BLOCK + continued % BLOCK, (counted, proxy.log_text()[-2000:])


def block_files(store: Path) -> dict[Path, int]:
    """The store's block files and their mtimes (temporary files aside)."""
    return {p: p.stat().st_mtime_ns for p in store.rglob("*")
            if p.is_file() and not p.name.endswith(".tmp")}


def test_a_damaged_block_is_a_miss_and_the_output_stays_exact(
    kv_pair: tuple[VllmServer, ...], kv_store: Path,
) -> None:
    """A stored block with flipped bytes: the continuation on the other server loads the
    block before it only, computes the rest, gives the uncut run's ids, and saves the
    block again in place of the damaged file."""
    first, second = kv_pair
    prompt = [(i * 7919) % 1500 + 5 for i in range(3 * BLOCK + 40)]
    old = block_files(kv_store)
    ids, cached = completion(first, prompt, 60)  # saves the prompt's and the answer's blocks
    assert cached == 0
    new = sorted((mtime, path) for path, mtime in block_files(kv_store).items()
                 if path not in old)
    assert len(new) >= 3  # blocks are saved in order: the second oldest is block 1
    victim = new[1][1]
    raw = bytearray(victim.read_bytes())
    raw[-7] ^= 0x5A
    victim.write_bytes(raw)
    rest, cached = completion(second, prompt + ids[:20], 40)
    assert rest == ids[20:]
    assert cached == BLOCK  # block 0 loaded; block 1 a miss, and all after it computed
    store = BlockStore(kv_store, 1 << 30)
    name, _, shard = victim.name.partition(".")
    assert store.verify(bytes.fromhex(name), suffix="." + shard)  # saved again, whole
