"""Request migration between real `ftctl sim` workers: by KV transfer and by re-prefill."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl.http1 import Client
from dynamo_ftctl.migrate.calibrate import (
    Calibration,
    PrefillFit,
    TransferFit,
    calibrate,
    load_calibration,
    prompt_ids,
    save_calibration,
    start_in_flight,
)
from dynamo_ftctl.migrate.transfer import Endpoint, MigrationResult, migrate_request
from tests import fetch

pytestmark = pytest.mark.integration

PROMPT_LEN, MAX_TOKENS, SEED, TEMPERATURE = 40, 48, 7, 0.8


def endpoint(worker: Any, name: str) -> Endpoint:
    return Endpoint(name=name, url=worker.url, admin_url=worker.url, token=worker.admin_token)


def slow_down(worker: Any, delay_ms: float = 20) -> None:
    """Make decoding slow enough that the request is still running when it is moved."""
    r = fetch.post(f"{worker.url}/admin/fault", json={"kind": "slow", "delay_ms": delay_ms},
                   headers={"Authorization": f"Bearer {worker.admin_token}"}, timeout=10)
    assert r.status == 200, r.text


def reference_ids(worker: Any) -> list[int]:
    body = {"model": "ftctl-sim-tiny", "prompt": prompt_ids(PROMPT_LEN), "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE, "seed": SEED, "ignore_eos": True,
            "return_token_ids": True}
    r = fetch.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert r.status == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == MAX_TOKENS
    return list(ids)


async def move(source: Endpoint, target: Endpoint, rid: str, method: str,
               calibration: Calibration | None = None) -> MigrationResult:
    client = Client()
    try:
        reader = await start_in_flight(client, source, "ftctl-sim-tiny", PROMPT_LEN,
                                       max_tokens=MAX_TOKENS, request_id=rid, seed=SEED,
                                       temperature=TEMPERATURE)
        try:
            return await migrate_request(client, source, target, rid, method=method,
                                         calibration=calibration)
        finally:
            reader.cancel()
    finally:
        await client.close()


@pytest.fixture
def pair(sim_worker_factory: Any) -> tuple[Any, Any]:
    a, b = sim_worker_factory(name="a"), sim_worker_factory(name="b")
    slow_down(a)
    return a, b


def test_kv_and_reprefill_continue_identically(pair: tuple[Any, Any]) -> None:
    """A sampled request moved mid-stream by KV or by re-prefill yields the reference tokens."""
    a, b = pair
    want = reference_ids(b)
    src, dst = endpoint(a, "a"), endpoint(b, "b")
    by_kv = asyncio.run(move(src, dst, "move-kv", "kv"))
    by_prefill = asyncio.run(move(src, dst, "move-prefill", "reprefill"))
    for result, method in ((by_kv, "kv"), (by_prefill, "reprefill")):
        assert result.method == method
        assert 0 < len(result.generated_before) < MAX_TOKENS  # really moved mid-stream
        assert list(result.output_token_ids) == want
        assert result.finish_reason == "length"
        assert result.context_tokens == PROMPT_LEN + len(result.generated_before)
    assert by_kv.payload_bytes > 0


def _calibration(setup_s: float) -> Calibration:
    return Calibration(
        worker="a", peer="b", model="ftctl-sim-tiny", layers=2, kv_heads=2, head_dim=32,
        dtype_bytes=4, block_size=16,
        prefill=PrefillFit(fixed_s=0.0, per_token_s=1e-3, per_token2_s=0.0),
        transfer=TransferFit(setup_s=setup_s, bandwidth_bytes_per_s=1e9),
    )


def test_auto_follows_the_calibrated_model(pair: tuple[Any, Any]) -> None:
    """With --method auto a cheap transfer picks kv and a costly setup picks re-prefill."""
    a, b = pair
    src, dst = endpoint(a, "a"), endpoint(b, "b")
    cheap = asyncio.run(move(src, dst, "auto-1", "auto", _calibration(setup_s=1e-4)))
    assert (cheap.method, cheap.plan is not None) == ("kv", True)
    costly = asyncio.run(move(src, dst, "auto-2", "auto", _calibration(setup_s=10.0)))
    assert costly.method == "reprefill"
    assert cheap.output_token_ids == costly.output_token_ids


def test_unknown_request_is_refused(pair: tuple[Any, Any]) -> None:
    """Moving a request the source does not hold is an InvalidInput naming the worker."""
    from dynamo_ftctl.errors import InvalidInput

    a, b = pair

    async def run() -> None:
        client = Client()
        try:
            await migrate_request(client, endpoint(a, "a"), endpoint(b, "b"), "nope",
                                  method="kv", timeout_s=10)
        finally:
            await client.close()

    with pytest.raises(InvalidInput, match="a: KV export of 'nope' refused"):
        asyncio.run(run())


def test_calibrate_fits_a_model_that_round_trips(sim_worker_factory: Any, tmp_path: Path) -> None:
    """Calibration measures both rates on live workers, saves a file that loads back, and
    reports each timed length as it goes (the CLI's progress line)."""
    a, b = sim_worker_factory(name="a"), sim_worker_factory(name="b")
    steps: list[tuple[int, int]] = []

    async def run() -> Calibration:
        client = Client()
        try:
            return await calibrate(client, endpoint(a, "a"), endpoint(b, "b"),
                                   lengths=(16, 128, 384, 768), repeats=1,
                                   on_progress=lambda done, total: steps.append((done, total)))
        finally:
            await client.close()

    cal = asyncio.run(run())
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert (cal.layers, cal.kv_heads, cal.head_dim, cal.dtype_bytes) == (2, 2, 32, 4)
    assert cal.prefill.per_token_s + cal.prefill.per_token2_s > 0
    assert [s.tokens for s in cal.prefill_samples] == [16, 128, 384, 768]
    assert len(cal.transfer_samples) == 4
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    assert load_calibration(path) == cal


def test_cli_request_and_bad_calibration_exit_codes(pair: tuple[Any, Any], tmp_path: Path) -> None:
    """`ftctl migrate request --json` moves a request; a broken calibration file exits 2."""
    a, b = pair
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(
        "cluster: t\nworkers:\n"
        f"  - {{name: a, url: '{a.url}', model: ftctl-sim-tiny}}\n"
        f"  - {{name: b, url: '{b.url}', model: ftctl-sim-tiny}}\n"
    )
    env = {**os.environ, "FTCTL_ADMIN_TOKEN": a.admin_token}
    # The CLI's interpreter starts while the request runs: at 20 ms a token the request
    # ended first on a loaded host (404 "no running or retained request"); 48 tokens at
    # 250 ms outlast any start-up.
    slow_down(a, delay_ms=250)

    async def start() -> tuple[Client, asyncio.Task[None]]:
        client = Client()
        task = await start_in_flight(client, endpoint(a, "a"), "ftctl-sim-tiny", PROMPT_LEN,
                                     max_tokens=MAX_TOKENS, request_id="cli-move", seed=SEED,
                                     temperature=TEMPERATURE)
        return client, task

    loop = asyncio.new_event_loop()
    try:
        client, task = loop.run_until_complete(start())
        proc = subprocess.run(
            [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "migrate", "request",
             "--request-id", "cli-move", "--from", "a", "--to", "b", "--method", "kv", "--json"],
            check=False, capture_output=True, text=True, env=env, timeout=120,
        )
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.run_until_complete(client.close())
    finally:
        loop.close()
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["method"] == "kv"
    assert doc["output_token_ids"] == reference_ids(b)

    bad = tmp_path / "cal.json"
    bad.write_text('{\n  "worker": "a",\n  "peer": "b",\n  "prefill": {"fixed_s": -1}\n}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "migrate", "request",
         "--request-id", "x", "--from", "a", "--to", "b", "--calibration", str(bad)],
        check=False, capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode == 2
    assert f"{bad}:" in proc.stderr
    assert proc.stdout == ""
