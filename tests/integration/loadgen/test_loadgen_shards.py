"""Shares of one run as real processes: `--shard I/N` with `--start-at` and `load merge`,
`--procs N`, and Ctrl-C stopping every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.interrupt import sigint_deliverable
from tests.waiting import wait_until

FTCTL = [sys.executable, "-m", "dynamo_ftctl"]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_shards_on_a_common_start_merge_into_one_run(start_target, tmp_path: Path):
    """Three shard processes started together send the run once; `load merge` makes one
    report of them whose counts and percentiles are those of all their samples."""
    url = start_target()
    start = time.time() + 3.0
    common = ["load", "--url", url, "--rate", "150", "--arrival", "constant", "--duration",
              "2s", "--max-tokens", "4", "--stream", "--start-at", f"{start:.3f}", "--no-plot",
              "--json"]
    procs = [subprocess.Popen([*FTCTL, *common, "--shard", f"{i}/3", "--out",
                               str(tmp_path / str(i))], stdout=subprocess.PIPE, text=True)
             for i in range(3)]
    docs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        docs.append(json.loads(out))
    finished = time.time()
    assert [d["planned_requests"] for d in docs] == [100, 100, 100]
    for doc in docs:  # how soon after `start` is the scheduler's: the fake clock's test
        assert start <= doc["started_at"] <= finished  # (test_loadgen_shard) times it
    merged = subprocess.run([*FTCTL, "load", "merge", *(str(tmp_path / str(i)) for i in range(3)),
                             "--out", str(tmp_path / "all"), "--no-plot", "--json"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert merged.returncode == 0, merged.stderr
    doc = json.loads(merged.stdout)
    assert doc["completed"] == doc["planned_requests"] == 300
    assert doc["config"]["shard"] is None
    rows = [json.loads(line) for line in
            (tmp_path / "all" / "requests.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(300))
    ttft = sorted(r["ttft_ms"] for r in rows)
    assert doc["ttft_ms"]["p99"] == pytest.approx(ttft[296], abs=1e-3)  # rank ceil(.99*300)
    assert doc["ttft_ms"]["max"] == pytest.approx(ttft[-1], abs=1e-3)


def test_merge_of_an_incomplete_set_is_refused(start_target, tmp_path: Path):
    """`load merge` with a shard missing exits 2 and names it."""
    url = start_target()
    for i in (0, 2):
        subprocess.run([*FTCTL, "load", "--url", url, "--users", "3", "--requests", "30",
                        "--max-tokens", "2", "--shard", f"{i}/3", "--out", str(tmp_path / str(i)),
                        "--no-plot", "--json"], capture_output=True, timeout=60, check=True)
    merged = subprocess.run([*FTCTL, "load", "merge", str(tmp_path / "0"), str(tmp_path / "2")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert merged.returncode == 2
    assert "missing: 1/3" in merged.stderr


def test_procs_share_one_plan(start_target, tmp_path: Path):
    """`--procs 2` sends the one-process plan, every request once, from two processes."""
    url = start_target()
    args = ["load", "--url", url, "--rate", "200", "--duration", "1.5s", "--max-tokens", "4",
            "--seed", "3", "--no-plot", "--json"]
    one = subprocess.run([*FTCTL, *args, "--out", str(tmp_path / "one")], capture_output=True,
                         text=True, timeout=60, check=True)
    two = subprocess.run([*FTCTL, *args, "--procs", "2", "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=60, check=True)
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert b["planned_requests"] == a["planned_requests"] == b["completed"]
    plan = [(r["index"], r["planned_s"]) for r in map(json.loads, (
        tmp_path / "one" / "requests.jsonl").read_text().splitlines())]
    rows = [json.loads(line) for line in (tmp_path / "two" / "requests.jsonl").read_text()
            .splitlines()]
    assert [(r["index"], r["planned_s"]) for r in rows] == plan


def test_ctrl_c_stops_every_process(start_target):
    """SIGINT to the parent of `--procs 3` ends it and its three processes, none left."""
    url = start_target()
    with sigint_deliverable():  # (a run started in the background ignores SIGINT)
        proc = subprocess.Popen([*FTCTL, "load", "--url", url, "--rate", "30", "--duration",
                                 "60s", "--max-tokens", "2", "--procs", "3"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _children(proc.pid), 20, "three load processes",
                   accept=lambda kids: len(kids) == 3)
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode != 0, err
        wait_until(lambda: [k for k in kids if not _gone(k)], 20, "every load process gone",
                   accept=lambda left: not left)
    finally:
        for kid in _children(proc.pid):
            os.kill(kid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_failing_process_fails_the_run_with_its_error(tmp_path: Path):
    """A process of `--procs 2` that cannot run (no such prompt file) fails the run with its
    own error line and exit status (2: bad input), not a hang or a partial report."""
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run([*FTCTL, "load", "--url", "http://127.0.0.1:9", "--rate", "5",
                           "--requests", "4", "--prompt-file", str(missing), "--procs", "2"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: load process 1 of 2 failed:")
    assert str(missing) in proc.stderr
