"""Rollbacks: undo what the method did, always (the runner calls them in a `finally`).

`revert_faults` reverts every injection still pending in the drill's own state
folder (`faults.inject.revert_pending`); `restart_workers` resumes a stopped
worker and restarts a dead one that `--local` started. A rollback that fails is
recorded, and the next one still runs.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import FtctlError

if TYPE_CHECKING:
    from dynamo_ftctl.drill.local import LocalStack
    from dynamo_ftctl.drill.state import DrillRun

__all__ = ["run_rollbacks"]


def run_rollbacks(run: DrillRun, stack: LocalStack) -> None:
    """Every rollback of the scenario, in order; each one's result goes to `run.rollbacks`."""
    for rollback in run.scenario.rollbacks:
        result = None  # restart_workers has nothing to do where the drill started nothing
        try:
            if rollback.action == "revert_faults":
                result = _revert_faults(run)
            elif stack.cluster is not None or stack.commands:
                result = _restart_dead(run, stack)
        except (FtctlError, OSError) as exc:
            result = f"{rollback.action} failed: {exc}"
        if result is not None:
            run.rollbacks.append(result)
            run.log(f"rollback: {result}")


def _revert_faults(run: DrillRun) -> str:
    from dynamo_ftctl.faults.inject import revert_pending
    from dynamo_ftctl.faults.injectors import Injectors

    result = revert_pending(
        all_=True, injectors=Injectors(environ={**os.environ, **run.env}),
        audit_log=run.out_dir / "audit.jsonl", state_dir=run.out_dir / "state")
    done = ", ".join(f"{r['fault']} {r['worker']}" for r in result.reverted)
    failed = ", ".join(f"{r['fault']} {r['worker']}: {r['error']}" for r in result.failed)
    text = f"reverted: {done or 'nothing pending'}"
    return text + (f"; FAILED: {failed}" if failed else "")


def _restart_dead(run: DrillRun, stack: LocalStack) -> str:
    from dynamo_ftctl.engine.launcher import start_worker

    restarted = []
    for command in stack.commands.values():
        if command.alive:
            command.child.signal(signal.SIGCONT)  # a SIGSTOPped group resumes
            continue
        command.restart()
        run.pids[command.name] = command.pid
        restarted.append(command.name)
    if stack.cluster is None or stack.launch_inventory is None:
        return f"restarted: {', '.join(restarted) or 'none needed'}"
    for worker in stack.launch_inventory.workers:
        process = stack.cluster.workers.get(worker.name)
        if process is None:
            continue
        if process.alive:
            process.child.signal(signal.SIGCONT)  # a SIGSTOPped engine resumes
            continue
        process.stop(timeout_s=0)
        sim = worker.launch.sim if worker.launch else None
        if sim is None:
            continue
        port = int(worker.url.rsplit(":", 1)[1])
        token_env = worker.admin.token_env if worker.admin else "FTCTL_ADMIN_TOKEN"
        new = start_worker(
            worker.name, port=port, seed=sim.seed, model_config=sim.model_config_name,
            args=(*sim.args, "--served-model-name", worker.model),
            pid_file=stack.cluster.state_dir / f"{worker.name}.pid",
            log_path=stack.cluster.state_dir / f"{worker.name}.restarted.log",
            admin_token_env=token_env, env=run.env, timeout_s=60,
        )
        stack.cluster.workers[worker.name] = new
        run.pids[worker.name] = new.pid
        restarted.append(worker.name)
    return f"restarted: {', '.join(restarted) or 'none needed'}"
