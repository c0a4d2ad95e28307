"""One run across several processes (`ftctl load --procs N`): one plan, shared out, merged.

The arrival plan is the run's, computed the same way in every process from the
same seed (it is a pure function of the config), and process j of N keeps every
N-th arrival from j (`Shard.split`): together they send exactly the requests,
at exactly the planned times, of one process. They start from a common wall-clock
time (`LoadConfig.start_at`, a moment ahead so that each has forked, set up its
client and asked the model first). Each writes its raw samples to a private
temporary directory (the `--out` files, without the plot); the parent reads them
back and merges them (`merge.merge_reports`, as `ftctl load merge` does), so
percentiles are exact over every request. `--abort-error-rate` applies to the whole
run: the processes keep their counts in one shared mapping (`tally.SharedTally`).

The processes are forks (no interpreter start; the parent has no thread and no
event loop at the fork), stopped and collected through `dynamo_ftctl.process`'s
`ForkedChild`: the parent stops all of them when it is interrupted or fails, and
each dies with its parent (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dynamo_ftctl.errors import ExitCode, FtctlError, InvalidInput
from dynamo_ftctl.loadgen.config import LoadConfig, Shard
from dynamo_ftctl.loadgen.runner import LoadReport, run_load
from dynamo_ftctl.loadgen.tally import SharedTally
from dynamo_ftctl.process import ForkedChild

__all__ = ["run_load_processes"]

# How far ahead of now the processes start when no --start-at is given: each forks,
# builds its event loop and client and asks the target for its model in this time
# (tens of ms on an idle machine; a loaded 2-core VM is slower).
START_MARGIN_S = 0.5
_STOP_DEADLINE_S = 2.0
_PR_SET_PDEATHSIG = 1  # prctl(2)
_ERROR_FILE = "error.txt"


class ShareFailed(FtctlError):
    """A process of a multi-process run failed; the message is its error. Exit 1, or 2
    when the process failed on bad input (`usage`)."""

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        if usage:
            self.exit_code = ExitCode.USAGE


def _arm_death_signal() -> Callable[[], None]:
    # Looked up before the fork: the child only makes the call (no dlopen after a fork).
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return arm


def _run_share(config: LoadConfig, out: Path, tally: SharedTally) -> int:
    """In the child: run the share, write its report; the exit status."""
    from dynamo_ftctl.loadgen.export import write_report

    try:
        write_report(run_load(config, tally=tally), out, plot=False, table=False)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # whatever it is reaches the parent as text
        from dynamo_ftctl.safefiles import write_into

        write_into(out, _ERROR_FILE, str(exc) if isinstance(exc, FtctlError)
                   else f"{type(exc).__name__}: {exc}")
        # Bad input stays bad input (exit 2) in the parent; anything else fails the run.
        return int(exc.exit_code) if isinstance(exc, FtctlError) else 1
    return 0


def _fork(config: LoadConfig, out: Path, arm: Callable[[], None],
          children: list[ForkedChild], tally: SharedTally) -> None:
    """Fork a process for `config`'s share and add it to `children`.

    SIGINT and SIGTERM are held from before the fork until the child is in `children`
    (the parent) or has armed its death signal (the child): a Ctrl-C in between would
    otherwise leave a child nobody stops, or one whose parent died before it could
    ask to die with it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        pid = os.fork()
        if pid == 0:  # the child never returns into the caller's code
            code = 1
            try:
                arm()
                if os.getppid() != parent:  # the parent is already gone
                    os._exit(1)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
                tally.index = len(children)
                code = _run_share(config, out, tally)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(ForkedChild(pid))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def run_load_processes(config: LoadConfig, procs: int, *,
                       now: Callable[[], float] = time.time) -> LoadReport:
    """Run `config` in `procs` forked processes sharing one plan; the merged report.

    With one process this is `run_load(config)`. The processes begin at
    `config.start_at`, or `START_MARGIN_S` from `now()` when it is None.
    """
    if procs < 1:
        msg = f"procs: must be at least 1, got {procs}"
        raise InvalidInput(msg)
    if procs == 1:
        return run_load(config)
    base = config.shard or Shard(0, 1)
    if config.schedule.users is not None and config.schedule.users < base.count * procs:
        msg = (f"procs: {config.schedule.users} users cannot be shared by {procs} processes"
               + (f" of shard {base}" if config.shard else ""))
        raise InvalidInput(msg)
    start_at = config.start_at if config.start_at is not None else now() + START_MARGIN_S
    # Loaded here, once, not in every child after the fork.
    from dynamo_ftctl.loadgen import export, merge, sender  # noqa: F401

    arm = _arm_death_signal()
    tally = SharedTally(procs)  # --abort-error-rate is the run's rule, across processes
    children: list[ForkedChild] = []
    with tempfile.TemporaryDirectory(prefix="ftctl-load-") as tmp:
        outs = [Path(tmp) / str(j) for j in range(procs)]
        try:
            for j, out in enumerate(outs):
                share = dataclasses.replace(config, shard=base.split(procs, j),
                                            start_at=start_at)
                _fork(share, out, arm, children, tally)
            codes = [child.wait() for child in children]
        finally:
            for child in children:
                child.stop(_STOP_DEADLINE_S)
        for j, (code, out) in enumerate(zip(codes, outs, strict=True)):
            if code != 0:
                error = out / _ERROR_FILE
                why = error.read_text() if error.exists() else f"exit status {code}"
                msg = f"load process {j + 1} of {procs} failed: {why}"
                raise ShareFailed(msg, usage=code == ExitCode.USAGE)
        merged = merge.merge_reports([merge.read_report_dir(out) for out in outs])
    return dataclasses.replace(merged, config=dataclasses.replace(merged.config,
                                                                  start_at=config.start_at))
