"""ftctl's KV connector in two real vLLM servers sharing a store, `ftctl proxy` in front.

The pair here runs `dynamo_ftctl.vllm_connector.FtctlConnector` on one temporary store,
with `--enable-prompt-tokens-details` (the proxy reads `cached_tokens`) and
`--max-num-batched-tokens 256`: the ~600-token prompt is prefilled in chunks, so blocks
are saved chunk by chunk and a continuation loads more than one chunk's worth. Before
it starts, the session's plain pair (if any) is stopped: two servers at once at most.

- A stream cut by SIGKILL at a random token (after the pacing fault proxy's reset, where
  that proxy is, as in test_vllm_proxy.py) goes on on the other server token-exact against an uncut run, and
  the proxy reports that server loaded all but at most one block plus the tokens past
  the last full block of the continued prompt.
- A block damaged in the store (bytes flipped) is a miss: the continuation loads the
  blocks before it, computes the rest, and its output is still exact.
- `ftctl migrate calibrate --via store`'s measurement on the pair: each timed request's
  connector report proves it loaded (or, sent with ftctl_load false, did not), and the
  fits and crossover are recorded.
- The proxy with a store calibration that prefers loading continues a cut stream from the
  store (counted `method="kv"`), one that prefers recompute turns the load off (counted
  `method="reprefill"`, nothing past the client's prompt loaded); output exact both ways.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl.kv.blockstore import BlockStore, chain_keys
from dynamo_ftctl.migrate.calibrate import (
    Calibration,
    PrefillFit,
    TransferFit,
    calibrate_store,
    load_calibration,
    save_calibration,
)
from dynamo_ftctl.migrate.transfer import Endpoint
from tests import fetch
from tests.integration.proxy.test_proxy_sim import ProxyFactory, proxy_factory, stream
from tests.integration.vllm import conftest
from tests.integration.vllm.server import VllmServer, spawn_vllm, wait_healthy
from tests.integration.vllm.test_vllm_proxy import (
    direct,
    paced,
    proxy_over,
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
    for line in fetch.get(f"{proxy_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("ftctl_migration_prompt_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            method = labels.split('method="')[1].split('"')[0]
            kind = labels.split('kind="')[1].split('"')[0]
            found[method, kind] = float(value)
    return found


def completion(server: VllmServer, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy ids and cached prompt tokens of a non-streamed completion from `server`."""
    resp = fetch.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "return_token_ids": True, "ignore_eos": True})
    assert resp.status == 200, resp.text
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
        killed = relays.cut_after(cut, lambda name: by_name[name].kill())
        proxy = proxy_over(relays.workers, kv_pair[0].model, proxy_factory)
        got = stream(proxy, endpoint, body)
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
    new = [path for path in block_files(kv_store) if path not in old]
    assert len(new) >= 3
    # Block 1 is the file whose key chains from another new file's key with block 1's ids
    # (`chain_keys`); not the second oldest: blocks saved within one clock tick of the
    # file system share their mtime.
    names = {path.name.partition(".")[0]: path for path in new}
    victim, = (names[chained] for name in names
               if (chained := chain_keys(bytes.fromhex(name), prompt[BLOCK:2 * BLOCK],
                                         BLOCK)[0].hex()) in names)
    raw = bytearray(victim.read_bytes())
    raw[-7] ^= 0x5A
    victim.write_bytes(raw)
    rest, cached = completion(second, prompt + ids[:20], 40)
    assert rest == ids[20:]
    assert cached == BLOCK  # block 0 loaded; block 1 a miss, and all after it computed
    store = BlockStore(kv_store, 1 << 30)
    name, _, shard = victim.name.partition(".")
    assert store.verify(bytes.fromhex(name), suffix="." + shard)  # saved again, whole


CALIBRATION_LENGTHS = (256, 768, 1280, 1792)


def test_calibrate_via_store_times_load_against_recompute_on_the_pair(
    kv_pair: tuple[VllmServer, ...], tmp_path: Path,
) -> None:
    """`calibrate_store` on the pair: fresh prompts computed on one server are timed on the
    other loaded from the store and recomputed (each request's connector report checked:
    a load that loaded nothing, or a recompute that loaded, raises), with the connector's
    geometry (the tiny Llama's 1 KiB per token, 128-token blocks), and both fits and the
    crossover recorded and saved."""
    from dynamo_ftctl.http1 import Client

    worker, peer = (Endpoint(name=s.name, url=s.url, admin_url=s.url) for s in kv_pair)

    async def measure() -> Calibration:
        client = Client()
        try:
            # Medians of three: one request slowed by the machine's other load (a
            # single repeat once fitted no growth with length at load 10) is outvoted.
            return await calibrate_store(client, worker, peer, lengths=CALIBRATION_LENGTHS,
                                         repeats=3, timeout_s=120)
        finally:
            await client.close()

    cal = asyncio.run(measure())
    assert (cal.via, cal.worker, cal.peer) == ("store", "kv1", "kv2")
    assert (cal.block_size, cal.kv_bytes_per_token) == (BLOCK, 1024)
    assert [s.tokens for s in cal.transfer_samples] == list(CALIBRATION_LENGTHS)
    assert [s.tokens for s in cal.prefill_samples] == list(CALIBRATION_LENGTHS)
    assert all(s.seconds > 0 for s in (*cal.transfer_samples, *cal.prefill_samples))
    assert cal.crossover_tokens == tuple(round(x) for x in cal.crossovers())
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    assert load_calibration(path) == cal


def migrations_counted(proxy_url: str) -> dict[str, float]:
    """ftctl_migrations_total by method."""
    found: dict[str, float] = {}
    for line in fetch.get(f"{proxy_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("ftctl_migrations_total{"):
            labels, value = line.rsplit(" ", 1)
            method = labels.split('method="')[1].split('"')[0]
            found[method] = found.get(method, 0.0) + float(value)
    return found


@pytest.mark.parametrize("choice", ["load", "recompute"])
def test_the_proxy_loads_or_recomputes_as_its_store_calibration_says(
    kv_pair: tuple[VllmServer, ...], proxy_factory: ProxyFactory, tmp_path: Path, choice: str,
) -> None:
    """A stream cut by the relay (the server lives on) continues on the other server: with
    a store calibration where loading wins, from the store (`method="kv"`, blocks past the
    client's prompt loaded); where recompute wins, with the store's load off
    (`method="reprefill"`, at most the client's prompt cached, by prefix caching); the
    output matches an uncut run either way."""
    model = kv_pair[0].model
    load_wins = choice == "load"
    path = tmp_path / "cal.json"
    save_calibration(Calibration(
        worker="kv1", peer="kv2", model=model, layers=2, kv_heads=2, head_dim=32,
        dtype_bytes=4, block_size=BLOCK, via="store",
        prefill=PrefillFit(fixed_s=0.0, per_token_s=1e-3),
        transfer=TransferFit(setup_s=0.0 if load_wins else 1e3,
                             bandwidth_bytes_per_s=1e12)), path)
    # A prompt no earlier test sent: no server's prefix cache holds its continuation.
    offset = 4000 if load_wins else 7000
    body = {"model": model, "prompt": README.read_text()[offset:offset + 2400],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True,
            "ignore_eos": True}
    with paced(kv_pair) as relays:
        cut = relays.cut_after(150)
        proxy = proxy_over(relays.workers, model, proxy_factory, calibration=str(path))
        got = stream(proxy, "/v1/completions", body)
        counted = prompt_tokens_counted(proxy.url)
        moved = migrations_counted(proxy.url)
    assert cut, "the stream ended before the cut"
    assert got.error is None, got.error
    assert got.migrated == 1
    expected = direct(kv_pair[0], "/v1/completions", body)
    assert got.ids == expected.ids
    prompt = len(expected.prompt_ids)
    if load_wins:
        assert moved == {"kv": 1.0}, (moved, proxy.log_text()[-2000:])
        assert counted[("kv", "loaded")] > prompt, counted
    else:
        assert moved == {"reprefill": 1.0}, (moved, proxy.log_text()[-2000:])
        assert counted[("reprefill", "loaded")] <= prompt, counted
        assert ("kv", "loaded") not in counted or not counted[("kv", "loaded")], counted
