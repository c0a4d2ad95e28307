"""Fault injection: plan a fault on one inventory worker, apply it, revert it.

`plan_injection` (in `plan.py`, re-exported here) is where safety lives: it
resolves a fault into `Step`s, so `--dry-run` prints exactly what
`run_injection` would do, and refuses (`InvalidInput`, exit 2) before anything
is touched.

`run_injection` writes the revert record first, applies the steps, appends to
the audit log, counts `ftctl_faults_injected_total`, and with a duration
waits and reverts (also on Ctrl-C). `revert_pending` applies the records a
crashed or duration-less injection left behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.documents import load_json_file
from dynamo_ftctl.errors import FtctlError, InvalidInput, InventoryError
from dynamo_ftctl.faultnames import FAULTS
from dynamo_ftctl.faults.audit import (
    AuditRecord,
    append_audit,
    default_audit_path,
    default_state_dir,
    who_am_i,
    write_record,
)
from dynamo_ftctl.faults.injectors import Injectors, Step
from dynamo_ftctl.faults.plan import (
    InjectionPlan,
    InjectOptions,
    check_confirmation,
    plan_injection,
    text_block,
)
from dynamo_ftctl.safefiles import check_log, child_name

if TYPE_CHECKING:
    from rich.console import RenderableType


__all__ = [
    "FaultListing",
    "InjectOptions",
    "InjectionPlan",
    "InjectionResult",
    "RevertResult",
    "check_confirmation",
    "list_faults",
    "pending_reverts",
    "plan_injection",
    "revert_pending",
    "run_injection",
]

@dataclass(frozen=True)
class InjectionResult:
    """What an injection did: its record id, each step's outcome, and the revert."""

    id: str
    plan: InjectionPlan
    outcomes: tuple[str, ...]
    reverted: bool
    pending_revert: Path | None
    audit_log: Path

    def to_json(self) -> dict[str, Any]:
        """The result as JSON."""
        return {"id": self.id, **self.plan.to_json(), "outcomes": list(self.outcomes),
                "reverted": self.reverted,
                "pending_revert": str(self.pending_revert) if self.pending_revert else None,
                "audit_log": str(self.audit_log)}

    def __rich__(self) -> RenderableType:
        lines = [f"injected {self.plan.fault} into {self.plan.worker} ({self.id})"]
        lines += [f"  {s.describe()}: {o}" for s, o in zip(self.plan.steps, self.outcomes,
                                                         strict=False)]
        if self.reverted:
            lines.append("  reverted")
        elif self.pending_revert is not None:
            lines.append(f"  in force until `ftctl inject revert {self.id}`")
        return text_block(lines)


@dataclass(frozen=True)
class RevertResult:
    """The pending reverts applied by `ftctl inject revert`."""

    reverted: tuple[dict[str, Any], ...]
    failed: tuple[dict[str, Any], ...] = ()

    def __rich__(self) -> RenderableType:
        if not self.reverted and not self.failed:
            return "nothing to revert"
        lines = [f"reverted {r['fault']} on {r['worker']} ({r['id']})" for r in self.reverted]
        lines += [f"FAILED to revert {r['fault']} on {r['worker']} ({r['id']}): {r['error']}"
                  for r in self.failed]
        return text_block(lines)


@dataclass(frozen=True)
class FaultListing:
    """The fault catalog (`ftctl inject --list`)."""

    faults: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def __rich__(self) -> RenderableType:
        from dynamo_ftctl.output import table

        return table("faults", ["fault", "destructive", "effect"],
                     [(f["name"], "yes" if f["destructive"] else "no", f["summary"])
                      for f in self.faults])


def list_faults() -> FaultListing:
    """Every fault name with its effect; Xid faults follow the Xid catalog."""
    from dynamo_ftctl.xid import XID_CATALOG

    rows: list[dict[str, Any]] = [
        {"name": s.name, "destructive": s.destructive, "summary": s.summary}
        for s in FAULTS.values()
    ]
    for code in sorted(XID_CATALOG):
        info = XID_CATALOG[code]
        rows.append({"name": f"xid{code}", "destructive": info.effect != "log",
                     "summary": f"{info.meaning} (effect: {info.effect})"})
    return FaultListing(tuple(rows))


# ---------------------------------------------------------------------------
# applying and reverting


def _reverts_dir(state_dir: Path) -> Path:
    return state_dir / "reverts"


def _audit(path: Path, clock: Clock, plan_fault: str, worker: str, *, result: str,
           steps: Sequence[Step], action: str) -> None:
    append_audit(path, AuditRecord(
        who=who_am_i(), when=AuditRecord.now(clock.wall()), what=plan_fault, target=worker,
        result=result, action=action, detail=tuple(s.describe() for s in steps),
    ))


def _apply_reverts(injectors: Injectors, steps: Sequence[Step]) -> list[str]:
    """Run every revert step, even after one fails; the errors, if any."""
    errors: list[str] = []
    for step in steps:
        try:
            injectors.execute(step)
        except FtctlError as exc:
            errors.append(f"{step.describe()}: {exc}")
    return errors


def run_injection(
    plan: InjectionPlan, *, injectors: Injectors | None = None, audit_log: Path | None = None,
    state_dir: Path | None = None, clock: Clock = SYSTEM_CLOCK,
) -> InjectionResult:
    """Apply a plan: revert record first, steps, audit, metric; wait and revert if timed."""
    from dynamo_ftctl.metrics import FAULTS_INJECTED

    injectors = injectors or Injectors()
    audit_log = check_log(audit_log or default_audit_path())  # refused before the fault
    state_dir = state_dir or default_state_dir()
    ident = f"{int(clock.wall() * 1000)}-{os.getpid()}-{plan.worker}-{plan.fault}"
    record: Path | None = None
    doc: dict[str, Any] = {"id": ident, "fault": plan.fault, "worker": plan.worker,
                           "created": clock.wall(), "duration_s": plan.duration_s,
                           "reverts": [s.to_json() for s in plan.reverts]}
    if plan.reverts:
        # The worker's name is data: one file name in the reverts folder, or exit 2.
        record = _reverts_dir(state_dir) / child_name(f"{ident}.json", what="revert record")
        write_record(record, doc)
    outcomes: list[str] = []
    try:
        for step in plan.steps:
            outcomes.append(injectors.execute(step))
        if record is not None:
            # What the steps did (a background load's pid, say) goes into the record too.
            write_record(record, {**doc, "outcomes": outcomes})
    except FtctlError as exc:
        # Half-applied: undo what can be undone, then report the failure.
        _apply_reverts(injectors, plan.reverts)
        if record is not None:
            record.unlink(missing_ok=True)
        _audit(audit_log, clock, plan.fault, plan.worker, result=f"failed: {exc}",
               steps=plan.steps, action="inject")
        raise
    _audit(audit_log, clock, plan.fault, plan.worker, result="ok", steps=plan.steps,
           action="inject")
    FAULTS_INJECTED.labels(fault=plan.fault, worker=plan.worker).inc()
    if plan.duration_s is None or not plan.reverts:
        return InjectionResult(ident, plan, tuple(outcomes), reverted=False,
                               pending_revert=record, audit_log=audit_log)
    try:
        clock.sleep(plan.duration_s)
    finally:
        # Ctrl-C during the wait still reverts: the finally runs before the interrupt leaves.
        errors = _apply_reverts(injectors, plan.reverts)
        _audit(audit_log, clock, plan.fault, plan.worker,
               result="ok" if not errors else "failed: " + "; ".join(errors),
               steps=plan.reverts, action="revert")
        if not errors and record is not None:
            record.unlink(missing_ok=True)
    if errors:
        msg = (f"revert of {plan.fault} on {plan.worker} failed: {'; '.join(errors)} "
               f"(record kept: {record}; retry with `ftctl inject revert --all`)")
        raise FtctlError(msg)
    return InjectionResult(ident, plan, tuple(outcomes), reverted=True, pending_revert=None,
                           audit_log=audit_log)


def pending_reverts(state_dir: Path | None = None) -> list[dict[str, Any]]:
    """Revert records still on disk, oldest first."""
    folder = _reverts_dir(state_dir or default_state_dir())
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        with contextlib.suppress(InventoryError):  # not one of ours: left for a person
            doc = load_json_file(path, what="a revert record (JSON)")
            if isinstance(doc, dict):
                doc["path"] = str(path)
                out.append(doc)
    return out


def revert_pending(
    ids: Sequence[str] = (), *, all_: bool = False, injectors: Injectors | None = None,
    audit_log: Path | None = None, state_dir: Path | None = None, clock: Clock = SYSTEM_CLOCK,
) -> RevertResult:
    """Apply pending revert records (those named, or all); each applied record is removed."""
    if not ids and not all_:
        msg = "name the injections to revert, or pass --all"
        raise InvalidInput(msg)
    injectors = injectors or Injectors()
    audit_log = check_log(audit_log or default_audit_path())
    records = pending_reverts(state_dir)
    if ids:
        known = {r["id"] for r in records}
        missing = [i for i in ids if i not in known]
        if missing:
            msg = f"no pending revert {missing[0]!r} (`ftctl inject revert --list` shows them)"
            raise InvalidInput(msg)
        records = [r for r in records if r["id"] in ids]
    done: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for rec in records:
        steps = [Step.from_json(s) for s in rec["reverts"]]
        errors = _apply_reverts(injectors, steps)
        summary = {"id": rec["id"], "fault": rec["fault"], "worker": rec["worker"]}
        _audit(audit_log, clock, rec["fault"], rec["worker"],
               result="ok" if not errors else "failed: " + "; ".join(errors), steps=steps,
               action="revert")
        if errors:
            failed.append({**summary, "error": "; ".join(errors)})
        else:
            Path(rec["path"]).unlink(missing_ok=True)
            done.append(summary)
    return RevertResult(tuple(done), tuple(failed))
