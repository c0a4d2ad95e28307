"""`ftctl migrate request` with a real vLLM worker, which has no admin KV API.

sim → vLLM: the export comes from the sim, the KV import is refused by vLLM's router (404),
and the request is re-prefilled there (the sim's ids, < 1030, are valid in the tiny Llama's
2048-token vocab). vLLM → sim: the request's state cannot be read from vLLM at all.
The vLLM server serves the sim's model name, as two workers of one pool would.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl.http1 import Client
from dynamo_ftctl.migrate.calibrate import start_in_flight
from dynamo_ftctl.migrate.transfer import Endpoint, KvApiMissing, migrate_request
from tests import fetch
from tests.integration.vllm.server import VllmServer, _free_port, wait_healthy
from tests.reaper import popen_group

SIM_MODEL = "ftctl-sim-tiny"
PROMPT_LEN, MAX_TOKENS, SEED = 24, 40, 3


@pytest.fixture(scope="module")
def vllm_worker(vllm_py: Path, tiny_llama: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM server serving the tiny Llama as `ftctl-sim-tiny`; stopped with its group."""
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(sorted(os.sched_getaffinity(0))[-1]),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [str(vllm_py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
            "--served-model-name", SIM_MODEL, "--dtype", "float32", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path_factory.mktemp("vllm-migrate") / "vllm.log"
    with log.open("wb") as out:
        proc = popen_group(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = VllmServer(name="vllm", url=f"http://127.0.0.1:{port}", model=SIM_MODEL,
                        proc=proc, log=log, argv=argv, env=env)
    try:
        wait_healthy(server, time.monotonic())
        yield server
    finally:
        server.stop()


def endpoint(name: str, url: str, token: str | None = None) -> Endpoint:
    return Endpoint(name=name, url=url, admin_url=url, token=token)


def test_kv_move_onto_vllm_falls_back_to_reprefill(
    sim_worker_factory: Any, vllm_worker: VllmServer,
) -> None:
    """sim → vLLM by kv: vLLM has no import API, so the request is re-prefilled and says so."""
    sim = sim_worker_factory(name="sim")
    slowed = fetch.post(f"{sim.url}/admin/fault", json={"kind": "slow", "delay_ms": 20},
                        headers={"Authorization": f"Bearer {sim.admin_token}"}, timeout=10)
    assert slowed.status == 200, slowed.text
    source = endpoint("sim", sim.url, sim.admin_token)
    target = endpoint("vllm", vllm_worker.url)

    async def move() -> Any:
        client = Client()
        try:
            reader = await start_in_flight(client, source, SIM_MODEL, PROMPT_LEN,
                                           max_tokens=MAX_TOKENS, request_id="to-vllm",
                                           seed=SEED, temperature=0.8, timeout_s=120)
            try:
                return await migrate_request(client, source, target, "to-vllm", method="kv",
                                             timeout_s=120)
            finally:
                reader.cancel()
        finally:
            await client.close()

    result = asyncio.run(move())
    assert result.requested == "kv"
    assert result.method == "reprefill"
    assert result.fallback is not None
    assert "vllm: no KV import API (POST /admin/kv/import answered HTTP 404)" in result.fallback
    assert result.generated_before
    assert result.context_tokens == PROMPT_LEN + len(result.generated_before)
    assert len(result.output_token_ids) == MAX_TOKENS  # ignore_eos: vLLM ran the rest
    assert len(result.continuation) == MAX_TOKENS - len(result.generated_before)
    assert result.finish_reason == "length"
    assert all(0 <= t < 2048 for t in result.continuation)


def test_move_from_vllm_is_one_clear_error(
    sim_worker_factory: Any, vllm_worker: VllmServer,
) -> None:
    """vLLM → sim: no export API on vLLM, so the state cannot be read; the proxy is named."""
    sim = sim_worker_factory(name="sim")

    async def move() -> Any:
        client = Client()
        try:
            return await migrate_request(client, endpoint("vllm", vllm_worker.url),
                                         endpoint("sim", sim.url, sim.admin_token),
                                         "any-request", method="reprefill", timeout_s=60)
        finally:
            await client.close()

    with pytest.raises(KvApiMissing) as caught:
        asyncio.run(move())
    message = str(caught.value)
    assert message.startswith("vllm: the state of request 'any-request' cannot be read")
    assert "GET /admin/kv/{id} answered HTTP 404" in message
    assert "`ftctl proxy` migrates requests" in message
    assert caught.value.exit_code == 2
