"""ftctl's commands against a real Dynamo 1.6.1 stack (frontend + mocker) in a namespace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.integration.dynamo.conftest import StackFactory, inventory
from tests.integration.dynamo.stack import MODEL, Namespace

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_probe_reports_what_the_frontend_supports(stacks: StackFactory, netns: Namespace,
                                                  tmp_path: Path) -> None:
    """`inventory show --probe`: no token ids, strict fields, health and metrics, the
    server named; every worker answered (exit 0)."""
    stack = stacks("a", 8001)
    inv = inventory(tmp_path / "dyn.yaml", [("fe1", stack.url)])
    done = netns.ftctl("-i", str(inv), "inventory", "show", "--probe", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["workers"]
    assert row["error"] is None
    assert (row["token_ids"], row["chat_token_ids"], row["strict_fields"]) == (False, False, True)
    assert (row["health"], row["metrics"], row["tokenize"], row["sleep"]) == (
        True, True, False, False)
    assert row["server"] == "nvidia"
    assert row["models"] == [MODEL]


def test_load_runs_bounded_against_the_frontend(stacks: StackFactory, netns: Namespace) -> None:
    """`ftctl load`, 20 streamed requests at 10/s, capped at 30 s: every one succeeds with
    its tokens (the mocker's text arrives one token a chunk)."""
    stack = stacks("a", 8001)
    done = netns.ftctl("load", "--url", stack.url, "--model", MODEL, "--rate", "10",
                       "--requests", "20", "--duration", "30s", "--max-tokens", "16",
                       "--stream", "--ignore-eos", "--json", timeout=90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert (doc["planned_requests"], doc["completed"], doc["failed"]) == (20, 20, 0)
    assert doc["output_tokens"] == 20 * 16
    assert doc["elapsed_s"] < 30


def test_canary_record_refuses_the_random_mocker_then_a_shape_set_passes(
        stacks: StackFactory, netns: Namespace, tmp_path: Path) -> None:
    """The mocker's greedy answers vary: `canary record` refuses (exit 1) saying why and
    naming --shape; `canary record --shape` records a set of kind shape that `ftctl canary`
    then passes (exit 0)."""
    stack = stacks("a", 8001)
    inv = inventory(tmp_path / "dyn.yaml", [("fe1", stack.url)])
    refused = netns.ftctl("-i", str(inv), "canary", "record", "-w", "fe1",
                          "-o", str(tmp_path / "golden.yaml"))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "gave different answers" in refused.stderr
    assert "--shape" in refused.stderr
    assert not (tmp_path / "golden.yaml").exists()
    recorded = netns.ftctl("-i", str(inv), "canary", "record", "-w", "fe1", "--shape",
                           "-o", str(tmp_path / "canary-set.yaml"))
    assert recorded.returncode == 0, recorded.stderr
    shape = yaml.safe_load((tmp_path / "canary-set.yaml").read_text())
    assert shape["kind"] == "shape"
    assert shape["return_token_ids"] is False
    assert all(p["finish_reasons"] == ["length"] for p in shape["prompts"])
    probed = netns.ftctl("-i", str(inv), "canary", "-w", "fe1", "--state-file",
                         str(tmp_path / "state.json"))
    assert probed.returncode == 0, probed.stdout + probed.stderr
    assert "HEALTHY" in probed.stdout
