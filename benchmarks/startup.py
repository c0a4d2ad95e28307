"""Start-up cost of `ftctl` as a ratio to a bare interpreter (issue: foundation).

Median wall time of 30 runs each, interleaved so that machine noise hits all
three alike: `python3 -c pass`, `ftctl --version`, `ftctl inventory check
examples/local.yaml`. Goals: --version <= 6x bare Python, inventory check <= 10x.
Then the imports that dominate `inventory check` (python -X importtime).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 30
FTCTL = shutil.which("ftctl", path=str(Path(sys.executable).parent)) or "ftctl"

CASES = {
    "python3 -c pass": [sys.executable, "-c", "pass"],
    "ftctl --version": [FTCTL, "--version"],
    "ftctl inventory check": [FTCTL, "inventory", "check", str(ROOT / "examples" / "local.yaml")],
}
GOALS = {"ftctl --version": 6.0, "ftctl inventory check": 10.0}
# An installed ftctl runs from byte code (pip compiles on install; an editable install
# writes it on first import). PYTHONDONTWRITEBYTECODE in the caller's environment would
# make every run compile the edited sources again and measure the compiler instead.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=ENV)
    return time.perf_counter() - start


def top_imports(argv: list[str], count: int = 8) -> list[tuple[int, str]]:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dynamo_ftctl", *argv[1:]],
        capture_output=True, text=True, check=True, env=ENV,
    )
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _self, cumulative, name = line.removeprefix("import time:").split("|")
        if not name.startswith("  "):  # top-level imports only (nested ones are indented)
            rows.append((int(cumulative), name.strip()))
    return sorted(rows, reverse=True)[:count]


def main() -> int:
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for argv in CASES.values():
        wall(argv)  # warm the page cache once
    for _ in range(RUNS):
        for name, argv in CASES.items():
            samples[name].append(wall(argv))
    base = statistics.median(samples["python3 -c pass"])
    print(f"{'command':<24}{'median ms':>10}{'ratio':>8}{'goal':>8}")
    failed = False
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = median / base
        goal = GOALS.get(name)
        mark = "" if goal is None else ("  ok" if ratio <= goal else "  MISSED")
        failed |= goal is not None and ratio > goal
        goal_text = f"<={goal:g}x" if goal else ""
        print(f"{name:<24}{median * 1000:>10.1f}{ratio:>7.1f}x{goal_text:>8}{mark}")
    print("\ntop-level imports of `ftctl inventory check` (cumulative us):")
    for micros, name in top_imports(CASES["ftctl inventory check"]):
        print(f"  {micros:>8}  {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
