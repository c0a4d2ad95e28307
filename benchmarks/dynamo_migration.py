"""Dynamo's own migration vs `ftctl proxy` in front, on NVIDIA Dynamo 1.6.1 (mocker, no GPU).

A worker (mocker) is SIGKILLed or SIGSTOPped once the client has seen CUT tokens of a
MAX_TOKENS completion stream. Two set-ups, each in a fresh network namespace:

- dynamo: one frontend (`--router-mode round-robin --migration-limit 3`), two mockers; the
  client streams from the frontend and the mocker named by nvext.worker_id is signalled.
- proxy: two frontends, one mocker each, `ftctl proxy` (stall_timeout_s STALL_S) over them;
  the mocker behind the frontend the proxy names (x-ftctl-worker) is signalled.

Per run: does the stream complete (finish_reason length, no error, [DONE]); the longest gap
between content chunks the client sees; the tokens: usage.completion_tokens and content
chunks against max_tokens (a chunk whose token ends inside a UTF-8 character comes out with
the next, so chunks may be one or two short without a token lost); and, after a SIGSTOP,
how many of LATER short requests (10 s each) succeed while the worker stays stopped.

    make dynamo && PYTHONPATH=src .venv/bin/python benchmarks/dynamo_migration.py [--runs 3]

Needs root (`ip netns`). Prints a table and one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from tests.integration.dynamo.stack import (  # noqa: E402
    MODEL,
    Namespace,
    Proc,
    Stack,
    can_make_namespaces,
    cleanup_all,
    dynamo_python,
    spawn,
    tokenizer_dir,
)

MAX_TOKENS = 400
CUT = 40
STALL_S = 2.0
DEADLINE_S = 15.0  # the client's read timeout: a stream silent this long has hung
LATER = 4


def stack(ns: Namespace, name: str, port: int, *, python: Path, model: Path, work: Path,
          mockers: int) -> Stack:
    s = Stack(ns, name, port, python, model, work / name)
    s.workdir.mkdir(parents=True)
    s.start_frontend()
    for _ in range(mockers):
        s.add_mocker()
    s.wait_serving()
    return s


def proxy_over(ns: Namespace, stacks: list[Stack], work: Path,
               model: Path) -> tuple[Proc, str]:
    """The proxy over `stacks`' frontends, counting their text with the model's tokenizer
    (Dynamo returns no ids and has no /tokenize: `tokenizer:`)."""
    inv = work / "proxy.yaml"
    inv.write_text(yaml.safe_dump({
        "cluster": "bench", "workers": [
            {"name": f"fe{i + 1}", "url": s.url, "model": MODEL, "tokenizer": str(model)}
            for i, s in enumerate(stacks)],
        "proxy": {"listen": "127.0.0.1:0", "scrape_interval_s": 0.2, "stall_timeout_s": STALL_S,
                  "breaker_threshold": 100000}}))
    proc = spawn(ns, "proxy", [sys.executable, "-m", "dynamo_ftctl", "-i", str(inv), "proxy"],
                 work / "proxy.log", {**os.environ, "FTCTL_ADMIN_TOKEN": "t"})
    end = time.monotonic() + 30
    while time.monotonic() < end:
        found = re.search(r"serving \d+ workers on (http://\S+)", proc.log_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.05)
    raise RuntimeError(proc.log_text()[-2000:])


def one_run(setup: str, sig: str, python: Path, model: Path) -> dict[str, Any]:
    ns = Namespace.create()
    work = Path(tempfile.mkdtemp(prefix="ftctl-dynbench-"))
    started: list[Stack] = []
    try:
        body: dict[str, Any] = {
            "model": MODEL, "prompt": "Why must a stream survive the failure of its worker?",
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
        if setup == "dynamo":
            started.append(stack(ns, "a", 8001, python=python, model=model, work=work, mockers=2))
            url, targets, by = started[0].url, started[0].instances, "nvext"
            body["nvext"] = {"extra_fields": ["worker_id"]}
        else:
            started += [stack(ns, name, port, python=python, model=model, work=work, mockers=1)
                        for name, port in (("a", 8001), ("b", 8002))]
            _, url = proxy_over(ns, started, work, model)
            targets = {f"fe{i + 1}": s.mockers[0].pid for i, s in enumerate(started)}
            by = "header"
        got = ns.client("stream", f"{url}/v1/completions", json.dumps(body), "--act-at",
                        str(CUT), "--signal", sig, "--targets", json.dumps(targets), "--by", by,
                        "--deadline", str(DEADLINE_S), timeout=120)
        later = None
        if sig == "STOP":
            short = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": True}
            later = 0
            for _ in range(LATER):
                doc = ns.client("stream", f"{url}/v1/completions", json.dumps(short),
                                "--deadline", "10", timeout=60)
                later += doc["finish"] == "length" and doc["error"] is None
        usage = (got.get("usage") or {}).get("completion_tokens")
        return {
            "setup": setup, "signal": sig,
            "completed": bool(got["finish"] == "length" and got["error"] is None
                              and got["done"]),
            "max_gap_s": round(got["max_gap_s"], 3),
            "gap_after_fault_s": (round(got["stall_after_act_s"], 3)
                                  if got["stall_after_act_s"] is not None else None),
            "usage_tokens": usage, "chunks": got["tokens"], "cut_after": got.get(
                "acted_after_tokens"), "error": got["error"], "timed_out": got["timed_out"],
            "continuation": got["headers"].get("x-ftctl-continuation"),
            "later_ok": later,
        }
    finally:
        for s in started:
            s.stop()
        cleanup_all()
        ns.delete()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    why = can_make_namespaces()
    python = dynamo_python()
    if why or not python.exists():
        print(f"cannot run: {why or f'no Dynamo venv at {python} (make dynamo)'}")
        return 1
    model = tokenizer_dir(python)
    rows: list[dict[str, Any]] = []
    try:
        for sig in ("KILL", "STOP"):
            for setup in ("dynamo", "proxy"):
                for _ in range(args.runs):
                    row = one_run(setup, sig, python, model)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        cleanup_all()
    print(f"\nmax_tokens {MAX_TOKENS}, fault after {CUT} tokens, {args.runs} runs each; "
          f"proxy stall_timeout_s {STALL_S}, client read timeout {DEADLINE_S} s")
    print(f"{'fault':6} {'setup':7} {'completed':9} {'max gap s (median, max)':24} "
          f"{'usage=max_tokens':17} {'chunks':12} later ok")
    for sig in ("KILL", "STOP"):
        for setup in ("dynamo", "proxy"):
            mine = [r for r in rows if r["signal"] == sig and r["setup"] == setup]
            gaps = [r["max_gap_s"] for r in mine]
            done = sum(r["completed"] for r in mine)
            exact = sum(r["usage_tokens"] == MAX_TOKENS for r in mine)
            chunks = ",".join(str(r["chunks"]) for r in mine)
            later = ",".join(f"{r['later_ok']}/{LATER}" for r in mine) if sig == "STOP" else "-"
            print(f"SIG{sig:4} {setup:7} {done}/{len(mine):<7} "
                  f"{statistics.median(gaps):.2f}, {max(gaps):.2f}{'':14} "
                  f"{exact}/{len(mine):<15} {chunks:12} {later}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
