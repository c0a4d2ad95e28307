"""Piped output is plain: no box-drawing characters, no progress, no cut URLs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
# Box drawing (U+2500-257F), rich's spinner (braille U+2800-28FF) and bar blocks.
DRAWN = [chr(c) for c in (*range(0x2500, 0x2580), *range(0x2800, 0x2900))] + ["━", "█"]
LONG_URL = ("http://inference-worker-0001.very-long-namespace.svc.cluster.example.internal"
            ":8000/v1/with/a/path/that/goes/on")


def _ftctl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True,
                          text=True, timeout=120, check=False, cwd=cwd,
                          env={**env, "TERM": "xterm-256color"})


def _plain(text: str) -> None:
    """Neither terminal control sequences nor drawn characters."""
    assert "\x1b" not in text
    assert "\r" not in text
    drawn = sorted({c for c in text if c in DRAWN})
    assert not drawn, f"drawn characters in piped output: {drawn}\n{text}"


def test_inject_list_piped_is_a_plain_table() -> None:
    """`inject --list | cat` prints aligned columns without a box."""
    done = _ftctl("-i", "examples/local.yaml", "inject", "--list")
    assert done.returncode == 0, done.stderr
    _plain(done.stdout + done.stderr)
    lines = done.stdout.splitlines()
    assert any(line.split()[:2] == ["fault", "destructive"] for line in lines), done.stdout
    assert any(line.startswith("kill ") for line in lines), done.stdout


def test_inventory_show_piped_keeps_long_urls_whole(tmp_path: Path) -> None:
    """A URL far past 80 columns prints whole on one line, with no ellipsis."""
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(yaml.safe_dump({"cluster": "wide", "workers": [
        {"name": "w1", "url": LONG_URL, "model": "m"}]}))
    done = _ftctl("-i", str(inventory), "inventory", "show")
    assert done.returncode == 0, done.stderr
    _plain(done.stdout + done.stderr)
    assert any(LONG_URL in line for line in done.stdout.splitlines()), done.stdout
    assert "…" not in done.stdout


def test_kv_bench_piped_has_no_progress_and_no_box() -> None:
    """`kv bench` piped (text or --json): the result only, no progress line, no box."""
    pytest.importorskip("torch")
    args = ("kv", "bench", "--blocks", "8", "--sweep-kib", "", "--repeats", "1",
            "--patterns", "random", "--kernel", "torch")
    text = _ftctl(*args)
    assert text.returncode == 0, text.stderr
    _plain(text.stdout + text.stderr)
    assert text.stderr == ""
    as_json = _ftctl(*args, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert as_json.stderr == ""
    assert as_json.stdout.lstrip().startswith("{")


def test_progress_off_a_terminal_draws_nothing_and_logs_plain_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Off a terminal `progress` draws nothing; its log lines are plain, none with --json."""
    from dynamo_ftctl.output import progress

    with progress("working") as line:
        line.update(1, 3, note="step one")
        line.print("did step one")
    with progress("working", quiet=True) as line:
        line.update(2, 3)
        line.print("not shown")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "did step one\n"


def test_inventory_show_on_a_narrow_terminal_folds_urls(tmp_path: Path) -> None:
    """On a 70-column terminal the URL cell folds onto more lines; no part of it is cut."""
    import re

    from tests.terminal import run_on_a_terminal

    inventory = tmp_path / "inv.yaml"
    inventory.write_text(yaml.safe_dump({"cluster": "wide", "workers": [
        {"name": "w1", "url": LONG_URL, "model": "m"}]}))
    code, seen = run_on_a_terminal(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "inventory", "show"],
        cwd=ROOT, deadline_s=60, columns=70)
    assert code == 0, seen
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen)
    assert "…" not in text
    rows = [line.split("│") for line in text.splitlines() if line.startswith("│")]
    assert "".join(row[2].strip() for row in rows) == LONG_URL, text


@pytest.mark.parametrize("args", [["xid", "48"], ["-i", "examples/local.yaml", "inject", "--list"]],
                         ids=["xid", "inject-list"])
def test_piped_tables_have_no_trailing_spaces(args: list[str]) -> None:
    """`ftctl xid 48 | cat`: no line ends in spaces (rich padded each to the widest row)."""
    done = _ftctl(*args)
    assert done.returncode == 0, done.stderr
    padded = [line for line in done.stdout.splitlines() if line.endswith(" ")]
    assert padded == [], done.stdout
