"""`ftctl canary` CLI: bad input exits 2 with one line; the one-shot path stays light."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("httpx", "torch", "aiohttp", "uvicorn", "starlette", "prometheus_client", "pydantic",
         "rich", "asyncio", "http.client", "ssl", "email")


def ftctl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True,
                          text=True, timeout=60, check=False, cwd=cwd,
                          env={**os.environ, "NO_COLOR": "1", "FTCTL_INVENTORY": ""})


def test_no_target_is_usage_error(tmp_path: Path) -> None:
    """Without --worker, --all or --url the command exits 2 naming the three choices."""
    proc = ftctl("canary", "--set", str(ROOT / "canaries" / "ftctl-sim-tiny.yaml"),
                 cwd=tmp_path)
    assert proc.returncode == 2
    assert "--worker NAME" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_bad_set_names_file_line_and_key(tmp_path: Path) -> None:
    """A broken canary set exits 2 with file:line: key before any request is sent."""
    bad = tmp_path / "set.yaml"
    bad.write_text("model: m\nprompts:\n  - name: a\n    prompt: hi\n    max_tokns: 3\n"
                   "    expected_text: x\n")
    proc = ftctl("canary", "--url", "http://127.0.0.1:9", "--set", str(bad), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{bad}:5: prompts[0].max_tokns: unknown key" in proc.stderr


def test_one_shot_imports_nothing_heavy(tmp_path: Path) -> None:
    """A one-shot probe (here against a closed port: exit 3) loads none of the heavy modules."""
    code = (
        "import sys\n"
        "from dynamo_ftctl.cli.main import main\n"
        f"rc = main(['canary', '--url', 'http://127.0.0.1:9', '--set', "
        f"{str(ROOT / 'canaries' / 'ftctl-sim-tiny.yaml')!r}, '--no-state', '--json'])\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print(rc, heavy, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=tmp_path)
    assert proc.stderr.strip().splitlines()[-1] == "3 []"
