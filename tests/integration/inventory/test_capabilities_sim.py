"""Capability discovery against a real `ftctl sim` worker, as a library call and as a command."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dynamo_ftctl.capabilities import probe_capabilities
from dynamo_ftctl.inventory import Worker
from tests.conftest import SIM_ADMIN_TOKEN

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def test_sim_worker_capabilities(shared_sim_worker: SimWorker) -> None:
    """The sim streams token ids on both endpoints, has health, vLLM metrics, sleep and KV export."""
    worker = Worker(name="sim", url=shared_sim_worker.url, model="ftctl-sim-tiny")
    caps = asyncio.run(probe_capabilities(worker, admin_token=SIM_ADMIN_TOKEN, timeout_s=10))
    assert caps.error is None, caps.notes
    assert caps.token_ids is True
    assert caps.prompt_token_ids is True
    assert caps.chat_token_ids is True
    assert caps.strict_fields is False
    assert caps.tokenize is False  # the sim has no /tokenize
    assert caps.health is True
    assert caps.metrics is True
    assert caps.load_metric == "vllm"
    assert caps.sleep is True
    assert caps.asleep is False
    assert caps.kv_export is True
    assert caps.models == ("ftctl-sim-tiny",)
    assert caps.max_model_len is not None
    assert caps.max_model_len > 0
    assert caps.server is not None
    assert caps.server.startswith("ftctl")


def test_cli_probe_exit_codes(shared_sim_worker: SimWorker, tmp_path: Path) -> None:
    """`inventory show --probe --json` as a process: the sim answers, a closed port exits 3."""
    inventory = tmp_path / "ftctl.yaml"
    inventory.write_text(
        "cluster: t\nworkers:\n"
        f"  - {{name: sim, url: '{shared_sim_worker.url}', model: ftctl-sim-tiny}}\n"
        "  - {name: gone, url: 'http://127.0.0.1:9', model: ftctl-sim-tiny}\n",
    )
    env = {**os.environ, "NO_COLOR": "1", "FTCTL_ADMIN_TOKEN": SIM_ADMIN_TOKEN}
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "inventory", "show",
         "--probe", "--json", "--timeout", "10"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT, env=env,
    )
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    workers = {w["worker"]: w for w in json.loads(proc.stdout)["workers"]}
    assert workers["sim"]["kv_export"] is True
    assert workers["sim"]["token_ids"] is True
    assert workers["gone"]["error"].startswith("unreachable")
