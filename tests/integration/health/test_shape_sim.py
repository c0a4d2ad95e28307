"""Shape sets against real `ftctl sim --nondeterministic` workers: record, pass, fail by fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dynamo_ftctl.health.canaryset import SHAPE_NOTE, load_canary_set
from tests import fetch
from tests.simfaults import hung
from tests.waiting import wait_until

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker
    from tests.conftest import SimWorkerFactory

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
EXACT = ROOT / "canaries" / "ftctl-sim-tiny.yaml"
# Generous: a loaded CI host slows a healthy answer several times over; the slow fault
# below (300 ms a step, 8 steps) is still far past 20 x the 50 ms floor.
TOLERANCE = "20"


def ftctl(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ftctl as the user would, bounded in time."""
    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True,
                          text=True, timeout=timeout_s, check=False, cwd=ROOT,
                          env={**os.environ, "NO_COLOR": "1", "FTCTL_NO_CACHE": "1"})
    assert "Traceback" not in proc.stderr
    return proc


def record(worker: SimWorker, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`canary record --url` of one sampled prompt, without the warm-up wait."""
    return ftctl("canary", "record", "--url", worker.url, "--model", "ftctl-sim-tiny", "-o",
                 str(out), "--warmup-timeout", "0", "--prompt", "capital=The capital of France is",
                 *extra)


def probe(worker: SimWorker, canary_set: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """A one-shot `canary --url --json` probe: its exit code and report."""
    proc = ftctl("canary", "--url", worker.url, "--set", str(canary_set), "--no-state",
                 "--json", *extra)
    return proc.returncode, json.loads(proc.stdout)


def fault(worker: SimWorker, **body: Any) -> None:
    """Play a fault on the worker through its admin API."""
    response = fetch.post(f"{worker.url}/admin/fault", json=body, timeout=5,
                          headers={"Authorization": f"Bearer {worker.admin_token}"})
    assert response.status == 200, response.text


@pytest.fixture
def random_worker(sim_worker_factory: SimWorkerFactory) -> SimWorker:
    """A sim as random at temperature 0 as Dynamo's mocker."""
    return sim_worker_factory(name="mocker", args=("--nondeterministic",))


@pytest.fixture
def shape_set(random_worker: SimWorker, tmp_path: Path) -> Path:
    """A shape set of one prompt recorded from `random_worker`."""
    out = tmp_path / "shape.yaml"
    proc = record(random_worker, out, "--shape", "--repeats", "3",
                  "--latency-tolerance", TOLERANCE)
    assert proc.returncode == 0, proc.stderr
    return out


def test_record_refuses_a_random_worker_and_names_shape(random_worker: SimWorker,
                                                        tmp_path: Path) -> None:
    """Without --shape the answers differ: exit 1, one line naming --shape, nothing written."""
    out = tmp_path / "exact.yaml"
    proc = record(random_worker, out)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "gave different answers" in lines[0]
    assert "--shape" in lines[0]
    assert not out.exists()


def test_a_shape_set_records_and_a_healthy_random_worker_passes(
    random_worker: SimWorker, shape_set: Path,
) -> None:
    """--shape writes kind: shape; probes pass again and again, labelled as the weaker kind,
    where the exact set fails the same healthy worker."""
    recorded = load_canary_set(shape_set)
    assert recorded.kind == "shape"
    assert recorded.samples == 3
    assert recorded.prompts[0].finish_reasons == ("length",)
    assert recorded.prompts[0].token_count == (8, 8)
    for _ in range(3):
        code, report = probe(random_worker, shape_set)
        assert code == 0, report
        assert (report["set_kind"], report["set_note"]) == ("shape", SHAPE_NOTE)
    code, report = probe(random_worker, EXACT)
    assert code == 1
    assert report["set_kind"] == "exact"


@pytest.mark.parametrize(("body", "code", "kind"), [
    ({"kind": "slow", "delay_ms": 300}, 1, "slow_answer"),
    ({"kind": "contained"}, 1, "bad_response"),
    ({"kind": "disconnect", "after_tokens": 2}, 3, "unreachable"),
], ids=["slow", "contained-xid", "disconnect"])
def test_a_faulty_random_worker_fails_its_shape(
    random_worker: SimWorker, shape_set: Path, body: dict[str, Any], code: int, kind: str,
) -> None:
    """A slow, an Xid-cut or a dropped answer fails with its kind and a one-line reason."""
    fault(random_worker, **body)
    got, report = probe(random_worker, shape_set)
    result = report["workers"][0]
    assert (got, result["kind"]) == (code, kind), result
    assert "\n" not in result["reason"]
    assert report["set_kind"] == "shape"


def test_a_hung_random_worker_is_unreachable(random_worker: SimWorker,
                                             shape_set: Path) -> None:
    """A hang costs one timeout: exit 3, judged by the shape set."""
    fault(random_worker, kind="hang")
    wait_until(lambda: hung(random_worker), 10, "the hang fault in effect")
    got, report = probe(random_worker, shape_set, "--timeout", "1")
    assert got == 3
    assert report["workers"][0]["kind"] == "unreachable"
    assert report["set_kind"] == "shape"
