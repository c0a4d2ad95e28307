"""ftctl's commands against a real Dynamo 1.6.1 stack (frontend + mocker) in a namespace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
