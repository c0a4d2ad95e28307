"""The `overload` fault: a bounded background load against one worker, stopped on revert.

`start_overload` spawns this module as its own process (`python -m
dynamo_ftctl.faults.overload ...`, a new session, so that it outlives the
injector) running the load generator (`loadgen.run_load`) at a rate and
concurrency meant to saturate the worker, always bounded in time (`--bound`).
It writes a pid file first thing (JSON: pid, argv, started), and the revert
record names that file: `stop_overload` (the revert step, also from
`ftctl inject revert --all` after a crashed injector) checks that the pid is
still this module's process (never a reused pid), SIGTERMs it, and waits with
a deadline (SIGKILL after) until that process, known by its start time
(`process.Identity`), is a zombie or gone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dynamo_ftctl.errors import Unreachable
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.process import SPAWNER, Identity, Spawner

__all__ = ["OverloadLoad", "main", "start_overload", "stop_overload"]

_MODULE = "dynamo_ftctl.faults.overload"
_START_TIMEOUT_S = 5.0
_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class OverloadLoad:
    """What the background load sends: to whom, how fast, how long at most."""

    url: str
    model: str
    rate: float = 200.0
    concurrency: int = 256
    bound_s: float = 600.0
    max_tokens: int = 64
    prompt_tokens: int = 64
    priority: str | None = None

    def argv(self) -> list[str]:
        """The command line of the load process."""
        argv = [sys.executable, "-m", _MODULE, "--url", self.url, "--model", self.model,
                "--rate", f"{self.rate:g}", "--concurrency", str(self.concurrency),
                "--bound", f"{self.bound_s:g}", "--max-tokens", str(self.max_tokens),
                "--prompt-tokens", str(self.prompt_tokens)]
        if self.priority:
            argv += ["--priority", self.priority]
        return argv


def start_overload(pid_file: Path, argv: list[str], *, spawner: Spawner = SPAWNER) -> str:
    """Spawn the load process; its pid goes to `pid_file` before this returns."""
    from dynamo_ftctl.output import write_atomic

    pid_file.parent.mkdir(parents=True, exist_ok=True)
    log = pid_file.with_suffix(".log")
    try:
        # Its own session: it outlives the injector. The spawner keeps it until its
        # end is collected (`reap` in the revert): no zombie, no warning.
        child = spawner.spawn(argv, stdout=log, stderr=log, append=True, group=True)
    except OSError as exc:
        msg = f"cannot start the load process: {exc.strerror or exc}"
        raise Unreachable(msg) from None
    write_atomic(pid_file, json.dumps({"pid": child.pid, "argv": argv,
                                       "started": time.time()}) + "\n")
    # A load that dies at once (bad URL, import error) is a failed injection, not a fault.
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        code = child.poll()
        if code is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            msg = (f"the load process exited at once with code {code}: "
                   f"{tail[0] if tail else 'no output'}")
            raise Unreachable(msg)
        if _started(log):
            break
        time.sleep(0.02)  # polling the load's "sending" line with a deadline
    return f"started load pid {child.pid} ({log})"


def _started(log: Path) -> bool:
    try:
        return b"sending" in log.read_bytes()
    except OSError:
        return False


def stop_overload(pid_file: Path, *, kill: Callable[[int, int], None] = os.kill,
                  spawner: Spawner = SPAWNER) -> str:
    """Stop the load named by `pid_file` (SIGTERM, SIGKILL after 5 s); gone already is fine.

    `kill` sends the signals (the injectors' seam); `spawner` collects the end of a load
    this process started."""
    try:
        pid = int(loads(pid_file.read_text())["pid"])
    except FileNotFoundError:
        return "no load running (pid file gone)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        msg = f"unreadable load pid file {pid_file}: {exc}"
        raise Unreachable(msg) from None
    load = Identity.of(pid, marker=_MODULE.encode())
    if load is None:
        spawner.reap(pid)
        pid_file.unlink(missing_ok=True)
        return f"load pid {pid} had already ended"
    ended_by = load.stop(_STOP_TIMEOUT_S, kill=kill)
    if ended_by is None:
        msg = f"load pid {pid} did not end after SIGKILL"
        raise Unreachable(msg)
    spawner.reap(pid)
    pid_file.unlink(missing_ok=True)
    return f"stopped load pid {pid} ({ended_by.name})"


def main(argv: list[str] | None = None) -> int:
    """Run the load until its bound or SIGTERM (the overload fault's process)."""
    from dynamo_ftctl.loadgen import Length, LoadConfig, Schedule, Workload, run_load

    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--bound", type=float, required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--priority", default=None)
    args = parser.parse_args(argv)
    config = LoadConfig(
        targets=(args.url,),
        schedule=Schedule(rate=args.rate, arrival="poisson", concurrency=args.concurrency),
        workload=Workload(model=args.model, prompt_tokens=Length.fixed(args.prompt_tokens),
                          max_tokens=Length.fixed(args.max_tokens), ignore_eos=True,
                          priority=args.priority),
        duration_s=args.bound, timeout_s=60.0,
    )
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(f"sending {args.rate:g} req/s (at most {args.concurrency} in flight) to {args.url} "
          f"for at most {args.bound:g} s", flush=True)
    report = run_load(config)
    summary = report.summary
    print(json.dumps({"completed": summary.completed, "failed": summary.failed,
                      "errors": summary.errors_by_class}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
