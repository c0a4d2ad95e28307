"""Run a chaos drill: hypothesis before → method → rollbacks (always) → hypothesis after → report.

`run_drill(path, local=...)` is the library behind `ftctl drill`. With
`local`, it first starts the scenario's inventory on loopback (`drill.local`)
and stops it all at the end, whatever happens. The whole drill is bounded by
the scenario's `timeout_s`; rollbacks run in a `finally`, even on Ctrl-C or a
failed step, and the hypothesis is asked again only after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.drill.counts import add_witness_counts, cut_streams, loads_counts, ttft_split
from dynamo_ftctl.drill.hypothesis import check_probes, detections, judge_drained, judge_metric
from dynamo_ftctl.drill.local import LocalStack, local_secrets, start_local
from dynamo_ftctl.drill.method import run_method
from dynamo_ftctl.drill.report import REPORT_FILES, DrillReport, write_report
from dynamo_ftctl.drill.rollback import run_rollbacks
from dynamo_ftctl.drill.scenario import METRIC_KINDS, load_scenario
from dynamo_ftctl.drill.state import DrillRun
from dynamo_ftctl.errors import FtctlError, Unreachable, require_extra
from dynamo_ftctl.safefiles import check_output_path, make_output_dir

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from dynamo_ftctl.drill.scenario import LoadProfile
    from dynamo_ftctl.loadgen.runner import LoadReport

__all__ = ["run_drill"]

Runs = list[tuple["LoadProfile", "LoadReport"]]


def run_drill(
    path: Path | str, *, local: bool = False, out_dir: Path | None = None,
    clock: Clock = SYSTEM_CLOCK, log: Callable[[str], None] | None = None,
    plot: bool = True,
) -> DrillReport:
    """Run one scenario end to end and write its report files under `out_dir`."""
    path = Path(path)
    scenario, inventory = load_scenario(path)
    if local and any(w.launch is not None and w.launch.sim is not None
                     for w in inventory.workers):
        # Before the report folder exists: a missing torch is an install to do (exit 2),
        # not a failed drill (exit 1).
        require_extra("torch")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(clock.wall()))
    out = out_dir or Path("reports") / "drills" / f"{path.stem}-{stamp}"
    make_output_dir(out)
    for name in REPORT_FILES:  # refused before the drill runs, not after
        check_output_path(out / name, follow_link=False)  # ftctl named it: no link
    env = local_secrets(inventory, secrets.token_hex(16)) if local else {}
    run = DrillRun(scenario=scenario, inventory=inventory, out_dir=out, clock=clock, env=env,
                   target_url=f"http://{inventory.proxy.listen}", local=local)
    if log is not None:
        run.log = log
    started_at = clock.wall()
    stack = LocalStack()
    state_probes = [p for p in scenario.hypothesis.probes if p.kind not in METRIC_KINDS]
    runs: Runs | None = None
    error: str | None = None
    interrupted = False
    before_ok = False
    try:
        with _deadline(scenario.timeout_s):
            try:
                if local:
                    run.inventory = start_local(inventory, out, env, stack)
                    run.target_url = f"http://{run.inventory.proxy.listen}"
                    run.pids = stack.pids()
                before = asyncio.run(check_probes(run, state_probes, "before"))
                run.probes.extend(before)
                before_ok = all(p.passed for p in before)
                if before_ok:
                    runs = asyncio.run(run_method(run))
            except KeyboardInterrupt:
                interrupted = True
                error = "interrupted"
            except FtctlError as exc:
                error = str(exc)
            finally:
                run_rollbacks(run, stack)
            if before_ok and not interrupted:
                run.probes.extend(asyncio.run(check_probes(run, state_probes, "after")))
    except FtctlError as exc:
        error = error or str(exc)
    finally:
        stack.stop()
    report = write_report(_report(run, path, started_at, runs, error, before_ok=before_ok),
                          plot=plot)
    if interrupted:
        raise KeyboardInterrupt
    return report


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM bounds the whole drill (main thread only; elsewhere unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(*_: object) -> None:
        msg = f"the drill ran past its timeout_s of {seconds:g} s"
        raise Unreachable(msg)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _report(run: DrillRun, path: Path, started_at: float, runs: Runs | None,
            error: str | None, *, before_ok: bool) -> DrillReport:
    """The counts, the metric probes' verdicts on them, and the drill's verdict."""
    scenario = run.scenario
    drained = detections(run, run.out_dir / "transitions.jsonl")
    first_fault = min((e.at_s for e in scenario.method.timeline if e.fault), default=None)
    records = sorted((r for _, rep in runs or () for r in rep.records), key=lambda r: r.planned)
    latency = ttft_split(records if runs else None, first_fault)
    counts: dict[str, Any] = {}
    if before_ok:
        run.probes.extend(judge_drained(run, p, drained)
                          for p in scenario.hypothesis.probes if p.kind == "drained_s")
    if runs:
        counts = loads_counts(runs)
        witness = scenario.method.witness
        if run.witnesses is not None and witness is not None:
            add_witness_counts(counts, run.witnesses, witness.max_tokens)
        counts["cut"] = cut_streams(runs, counts.get("witness"))
        if run.proxy_migrations is not None:
            counts["migrated"] = max(counts["migrated"], run.proxy_migrations)
        run.probes.extend(judge_metric(p, counts, latency.get("ttft_p99_ms"))
                          for p in scenario.hypothesis.probes
                          if p.kind in METRIC_KINDS and p.kind != "drained_s")
    passed = (before_ok and error is None
              and (bool(runs) or not scenario.method.profiles)
              and all(p.passed for p in run.probes))
    return DrillReport(
        scenario=str(path), title=scenario.title, local=run.local, passed=bool(passed),
        started_at=started_at, elapsed_s=round(run.clock.wall() - started_at, 3),
        error=error, counts=counts, latency=latency, probes=tuple(run.probes),
        events=tuple(sorted(run.events, key=lambda e: e.t_s)), rollbacks=tuple(run.rollbacks),
        states=tuple(run.states), out_dir=run.out_dir, detections=drained,
        records=tuple((r.planned, r.done, r.ttft_s, r.ok, r.status) for r in records),
    )
