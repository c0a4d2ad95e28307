"""Planning a fault injection: what injecting a fault into one worker does, step by step.

`plan_injection` is where safety lives: only workers in the inventory, only
faults in their `faults` allowlist, never a `protected` worker, and only
through the injectors the worker's `inject.injectors` allows. It resolves
everything (pid, URL, token variable, log line, command) into `Step`s, so
`--dry-run` prints exactly what `inject.run_injection` would do. Refusals are
`InvalidInput` (exit 2) raised before anything is touched. Nothing here has a
side effect: applying and reverting a plan is `inject.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.faultnames import FAULTS, fault_names, is_known_fault
from dynamo_ftctl.faults.audit import default_state_dir
from dynamo_ftctl.faults.injectors import DCGM_XID_FIELD, Step, xid_kmsg_line

if TYPE_CHECKING:
    from rich.console import RenderableType

    from dynamo_ftctl.inventory import Inventory, Worker

__all__ = ["InjectOptions", "InjectionPlan", "check_confirmation", "plan_injection",
           "text_block"]

# DCGM_FI_DEV_ECC_DBE_VOL_TOTAL and DCGM_FI_DEV_CLOCK_THROTTLE_REASONS (dcgm_fields.h);
# 0x40 is DCGM_CLOCKS_THROTTLE_REASON_HW_THERMAL.
_DCGM_ECC_DBE_FIELD = 312
_DCGM_THROTTLE_FIELD = 112
_THROTTLE_HW_THERMAL = 0x40


def text_block(lines: Sequence[str]) -> RenderableType:
    """Lines printed as they are: never wrapped, so a dry run shows each step exactly."""
    from rich.text import Text

    return Text("\n".join(lines), no_wrap=True, overflow="ignore")


@dataclass(frozen=True)
class InjectOptions:
    """Knobs of one injection (CLI flags; drills set them per timeline entry)."""

    pid: int | None = None
    kmsg_path: Path | None = None
    gpuid: int | None = None
    delay_ms: float = 50.0
    jitter_ms: float = 0.0
    after_tokens: int = 20
    rate_kbps: float = 64.0
    duration_s: float | None = None
    rate: float = 200.0
    concurrency: int = 256
    load_bound_s: float = 600.0
    state_dir: Path | None = None


@dataclass(frozen=True)
class InjectionPlan:
    """What injecting `fault` into `worker` does, step by step, and how it is undone."""

    fault: str
    worker: str
    summary: str
    destructive: bool
    steps: tuple[Step, ...]
    reverts: tuple[Step, ...] = ()
    duration_s: float | None = None

    def lines(self) -> list[str]:
        """The plan as the lines `--dry-run` prints."""
        out = [f"inject {self.fault} into {self.worker}: {self.summary}"]
        out += [f"  {i}. {step.describe()}" for i, step in enumerate(self.steps, 1)]
        if self.reverts:
            when = (f"after {self.duration_s:g} s" if self.duration_s is not None
                    else "on `ftctl inject revert`")
            out.append(f"  revert {when}:")
            out += [f"  {i}. {step.describe()}" for i, step in enumerate(self.reverts, 1)]
        else:
            out.append("  revert: none (the fault ends the process; restart it)")
        return out

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON (`--dry-run --json`, drill reports)."""
        return {"fault": self.fault, "worker": self.worker, "summary": self.summary,
                "destructive": self.destructive, "duration_s": self.duration_s,
                "steps": [s.to_json() for s in self.steps],
                "reverts": [s.to_json() for s in self.reverts]}

    def __rich__(self) -> RenderableType:
        return text_block(self.lines())


# planning


class _Target:
    """One worker's resolved reach: pid, admin URL, log path, GPUs."""

    def __init__(self, inventory: Inventory, worker: Worker, options: InjectOptions) -> None:
        self.inventory = inventory
        self.worker = worker
        self.options = options
        self.allowed = worker.inject.injectors

    def has(self, kind: str) -> bool:
        return kind in self.allowed

    def pid(self, *, required: bool) -> int | None:
        if self.options.pid is not None:
            return self.options.pid
        ref = self.worker.process
        if ref is not None and ref.pid is not None:
            return ref.pid
        # process.pid_file, else the file `ftctl sim cluster` wrote for a launch.sim worker:
        # one rule for both sides (engine.launcher.cluster_pid_file)
        from dynamo_ftctl.engine.launcher import cluster_pid_file

        path = cluster_pid_file(self.inventory, self.worker)
        if path is not None:
            return self._read_pid(path, required=required,
                                  started=ref is None or ref.pid_file is None)
        if required:
            msg = (f"worker {self.worker.name}: no pid (set process.pid_file in the inventory "
                   "or pass --pid)")
            raise InvalidInput(msg)
        return None

    def _read_pid(self, path: Path, *, required: bool, started: bool) -> int | None:
        """The pid in `path`; `started`: the file is the one `ftctl sim cluster` writes."""
        try:
            with path.open("rb") as handle:  # a pid is a few bytes; /dev/zero is not one
                text = handle.read(64).decode("ascii", "replace").strip()
        except OSError as exc:
            if not required:
                return None
            hint = (" (`ftctl sim cluster` writes it while it runs: is it running, with the "
                    "same FTCTL_STATE_DIR? else pass --pid)") if started else ""
            msg = (f"worker {self.worker.name}: cannot read pid file {path}: "
                   f"{exc.strerror}{hint}")
            raise InvalidInput(msg) from None
        if text.isdigit() and int(text) > 0:
            return int(text)
        if required:
            msg = f"worker {self.worker.name}: pid file {path} holds no pid: {text[:40]!r}"
            raise InvalidInput(msg)
        return None

    def signal(self, name: str) -> Step:
        pid = self.pid(required=True)
        assert pid is not None
        if self.worker.process is None or not self.worker.process.group:
            return Step("signal", str(pid), {"signal": name})
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            pgid = pid  # gone already: the injector says so when the step runs
        if pgid != pid:
            msg = (f"worker {self.worker.name}: pid {pid} does not lead a process group (its "
                   f"group is {pgid}): process.group would signal the wrong processes; start "
                   "the engine in its own session (setsid) or set process.group: false")
            raise InvalidInput(msg)
        return Step("signal", str(pid), {"signal": name, "group": True})

    def http(self, body: dict[str, Any]) -> Step:
        token_env = self.worker.admin.token_env if self.worker.admin else "FTCTL_ADMIN_TOKEN"
        return Step("http", f"{self.worker.admin_url}/admin/fault",
                    {"body": body, "token_env": token_env})

    def kmsg(self, xid: int) -> Step:
        path = self.options.kmsg_path or self.worker.inject.kmsg_path
        pid = self.pid(required=False)
        process = _process_name(pid) if pid is not None else self.worker.name
        line = xid_kmsg_line(xid, self.worker.inject.pci_bus_id,
                             pid if pid is not None else "'N/A'", process)
        return Step("kmsg", str(path), {"line": line})

    def gpus(self) -> tuple[int, ...]:
        if self.options.gpuid is not None:
            return (self.options.gpuid,)
        if self.worker.gpus:
            return self.worker.gpus
        msg = f"worker {self.worker.name}: no GPU for dcgmi (set gpus in the inventory or --gpuid)"
        raise InvalidInput(msg)

    def dcgm(self, field_id: int, value: int) -> list[Step]:
        return [Step("dcgm", "dcgmi", {"argv": [
            "dcgmi", "test", "--inject", "--gpuid", str(g), "-f", str(field_id),
            "-v", str(value)]}) for g in self.gpus()]

    def net(self, method: str, path: str, body: dict[str, Any] | None = None) -> Step:
        url = self.worker.inject.netproxy
        if url is None:
            msg = (f"worker {self.worker.name}: no TCP fault proxy in front of it "
                   "(set inject.netproxy to its control URL)")
            raise InvalidInput(msg)
        return Step("net", f"{url}{path}", {"method": method, "body": body,
                                            "token_env": self.worker.inject.netproxy_token_env})

    def need(self, fault: str, *kinds: str) -> None:
        if not any(self.has(k) for k in kinds):
            msg = (f"worker {self.worker.name}: fault {fault!r} needs the "
                   f"{' or '.join(kinds)} injector; its injectors: {', '.join(self.allowed)}")
            raise InvalidInput(msg)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "python3"
    except OSError:
        return "python3"


_CLEAR = {"kind": "clear"}


def _plan_steps(fault: str, t: _Target) -> tuple[str, list[Step], list[Step]]:
    """(summary, steps, reverts) for one fault on one worker."""
    o = t.options
    if fault in ("kill", "term"):
        t.need(fault, "signal")
        name = "SIGKILL" if fault == "kill" else "SIGTERM"
        return FAULTS[fault].summary, [t.signal(name)], []
    if fault == "hang":
        if t.has("signal"):
            return FAULTS[fault].summary, [t.signal("SIGSTOP")], [t.signal("SIGCONT")]
        t.need(fault, "http")
        return ("stall the engine's steps and requests (admin hang)", [t.http({"kind": "hang"})],
                [t.http(_CLEAR)])
    if fault in ("slow", "disconnect", "sdc"):
        t.need(fault, "http")
        body: dict[str, Any] = {"kind": fault}
        if fault == "slow":
            body["delay_ms"] = o.delay_ms
        if fault == "disconnect":
            body["after_tokens"] = o.after_tokens
        return FAULTS[fault].summary, [t.http(body)], [t.http(_CLEAR)]
    if fault == "thermal":
        t.need(fault, "http")
        steps = [t.http({"kind": "slow", "delay_ms": o.delay_ms})]
        reverts = [t.http(_CLEAR)]
        if t.has("dcgm"):
            steps += t.dcgm(_DCGM_THROTTLE_FIELD, _THROTTLE_HW_THERMAL)
            reverts += t.dcgm(_DCGM_THROTTLE_FIELD, 0)
        return FAULTS[fault].summary, steps, reverts
    if fault == "ecc":
        t.need(fault, "kmsg", "dcgm")
        # Xid 63: a row marked for remapping, what a rising ECC count logs on A100+.
        steps = [t.kmsg(63)] if t.has("kmsg") else []
        if t.has("dcgm"):
            steps += t.dcgm(_DCGM_ECC_DBE_FIELD, 1)
        return FAULTS[fault].summary, steps, []
    if fault.startswith("net-"):
        return _plan_net(fault, t)
    if fault.startswith("xid"):
        return _plan_xid(fault, int(fault[3:]), t)
    return _plan_overload(t)


def _plan_overload(t: _Target) -> tuple[str, list[Step], list[Step]]:
    """A background load process against the worker, bounded; the revert stops it."""
    import secrets

    from dynamo_ftctl.faults.overload import OverloadLoad

    o = t.options
    if o.rate <= 0 or o.concurrency < 1:
        msg = "overload: --rate must be positive and --concurrency at least 1"
        raise InvalidInput(msg)
    # Bounded even when the revert never comes: the duration (plus a margin) or the cap.
    bound = min(o.load_bound_s, o.duration_s + 5.0) if o.duration_s else o.load_bound_s
    load = OverloadLoad(url=t.worker.url, model=t.worker.model, rate=o.rate,
                        concurrency=o.concurrency, bound_s=bound)
    folder = (o.state_dir or default_state_dir()) / "loads"
    pid_file = str(folder / f"{t.worker.name}-{secrets.token_hex(4)}.json")
    summary = (f"{o.rate:g} req/s, at most {o.concurrency} in flight, against "
               f"{t.worker.url} for at most {bound:g} s")
    return (summary, [Step("load", pid_file, {"action": "start", "argv": load.argv()})],
            [Step("load", pid_file, {"action": "stop"})])


def _plan_net(fault: str, t: _Target) -> tuple[str, list[Step], list[Step]]:
    t.need(fault, "net")
    o = t.options
    toxics: dict[str, dict[str, Any]] = {
        "net-latency": {"kind": "latency", "latency_ms": o.delay_ms, "jitter_ms": o.jitter_ms},
        "net-reset": {"kind": "reset_peer", "timeout_ms": 0},
        "net-blackhole": {"kind": "blackhole"},
        "net-bandwidth": {"kind": "bandwidth", "rate_kbps": o.rate_kbps},
    }
    toxic = toxics[fault]
    name = f"ftctl-{fault}"
    toxic["name"] = name
    steps = [t.net("POST", "/toxics", toxic)]
    if fault == "net-blackhole":
        steps.append(t.net("POST", "/toxics", {**toxic, "name": f"{name}-up",
                                               "direction": "upstream"}))
        return (FAULTS[fault].summary, steps,
                [t.net("DELETE", f"/toxics/{name}"), t.net("DELETE", f"/toxics/{name}-up")])
    return FAULTS[fault].summary, steps, [t.net("DELETE", f"/toxics/{name}")]


def _plan_xid(fault: str, xid: int, t: _Target) -> tuple[str, list[Step], list[Step]]:
    from dynamo_ftctl.xid import lookup_xid

    info = lookup_xid(xid)
    logs: list[Step] = []
    if t.has("kmsg"):
        logs.append(t.kmsg(xid))
    if t.has("dcgm"):
        logs += t.dcgm(DCGM_XID_FIELD, xid)
    summary = f"Xid {xid} {info.meaning} (effect: {info.effect})"
    if info.effect == "log":
        t.need(fault, "kmsg", "dcgm")
        return summary, logs, []
    if info.effect == "crash" and t.has("http"):
        # The sim engine prints the Xid line itself and exits.
        return summary, [*logs, t.http({"kind": "crash", "xid": xid})], []
    if info.effect in ("crash", "hang"):
        # Without an admin API (vLLM, SGLang…) nothing can raise an Xid inside the engine:
        # what stays honest is the driver's line where GPU agents read it, then what the
        # Xid does to the process. Without a log step that would be `kill`/`hang` renamed.
        sig, plain = ("SIGKILL", "kill") if info.effect == "crash" else ("SIGSTOP", "hang")
        if info.effect == "hang" and t.has("signal") and (logs or not t.has("http")):
            _need_xid_log(fault, t, sig, plain)
            return summary, [*logs, t.signal("SIGSTOP")], [t.signal("SIGCONT")]
        if info.effect == "hang" and t.has("http"):
            return summary, [*logs, t.http({"kind": "hang"})], [t.http(_CLEAR)]
        t.need(fault, "http", "signal")
        _need_xid_log(fault, t, sig, plain)
        return summary, [*logs, t.signal("SIGKILL")], []
    # "request" (contained): the one request running on the faulty context ends with an
    # error, the engine logs the Xid and keeps serving; nothing to revert. Only an engine's
    # own admin API can fail one request: no signal does that.
    if not t.has("http"):
        msg = (f"worker {t.worker.name}: {fault} is contained (one request fails, the engine "
               "keeps serving): only the engine's admin API can do that (http injector, "
               f"`/admin/fault`); its injectors: {', '.join(t.allowed)}")
        raise InvalidInput(msg)
    return summary, [*logs, t.http({"kind": "contained", "xid": xid})], []


def _need_xid_log(fault: str, t: _Target, sig: str, plain: str) -> None:
    """An Xid fault by signal alone must log the Xid line, or it is only `kill`/`hang`."""
    if t.has("kmsg") or t.has("dcgm"):
        return
    msg = (f"worker {t.worker.name}: {fault} without an admin API is the driver's Xid line "
           f"(kmsg or dcgm injector) then {sig}: allow kmsg in inject.injectors (with "
           f"inject.kmsg_path), or inject {plain!r}")
    raise InvalidInput(msg)


def _fault_is_destructive(fault: str) -> bool:
    if fault in FAULTS:
        return FAULTS[fault].destructive
    from dynamo_ftctl.xid import lookup_xid

    return lookup_xid(int(fault[3:])).effect != "log"


def plan_injection(inventory: Inventory, worker_name: str, fault: str,
                   options: InjectOptions | None = None) -> InjectionPlan:
    """Resolve `fault` on `worker_name` into steps; `InvalidInput` when it is not allowed."""
    options = options or InjectOptions()
    if not is_known_fault(fault):
        import difflib

        close = difflib.get_close_matches(fault, fault_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        msg = f"unknown fault {fault!r}{hint}; `ftctl inject --list` shows the catalog"
        raise InvalidInput(msg)
    worker = inventory.worker(worker_name)
    if worker.protected:
        msg = f"worker {worker.name} is protected: fault injection refused"
        raise InvalidInput(msg)
    if fault not in worker.faults:
        allowed = ", ".join(worker.faults) or "none"
        msg = (f"fault {fault!r} is not in worker {worker.name}'s faults allowlist "
               f"({allowed})")
        raise InvalidInput(msg)
    if options.duration_s is not None and options.duration_s <= 0:
        msg = "--duration must be positive"
        raise InvalidInput(msg)
    summary, steps, reverts = _plan_steps(fault, _Target(inventory, worker, options))
    return InjectionPlan(
        fault=fault, worker=worker.name, summary=summary,
        destructive=_fault_is_destructive(fault), steps=tuple(steps), reverts=tuple(reverts),
        duration_s=options.duration_s,
    )


def check_confirmation(plan: InjectionPlan, *, yes: bool, interactive: bool) -> bool:
    """True when the user must be asked; `InvalidInput` when no one can be asked."""
    if not plan.destructive or yes:
        return False
    if interactive:
        return True
    msg = (f"{plan.fault} is destructive and stdin is not a terminal: pass --yes to "
           f"inject it into {plan.worker}")
    raise InvalidInput(msg)
