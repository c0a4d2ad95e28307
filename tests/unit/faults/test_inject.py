"""Fault injection: planning and safety, execution through fakes, audit, reverts."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput, Unreachable
from dynamo_ftctl.faults.audit import read_audit
from dynamo_ftctl.faults.inject import (
    InjectOptions,
    check_confirmation,
    list_faults,
    pending_reverts,
    plan_injection,
    revert_pending,
    run_injection,
)
from dynamo_ftctl.faults.injectors import Injectors, Step
from dynamo_ftctl.http1 import MockTransport, Reply, Request
from dynamo_ftctl.inventory import Inventory, parse_inventory
from dynamo_ftctl.metrics import REGISTRY
from dynamo_ftctl.process import FakeSpawner

INVENTORY = """
cluster: t
workers:
  - name: w1
    url: http://127.0.0.1:8101
    model: m
    gpus: [0, 1]
    admin: {token_env: T_TOKEN}
    process: {pid: 4242}
    faults: [kill, hang, slow, sdc, disconnect, xid48, xid63, xid94, xid43, net-latency, ecc,
             overload]
    inject: {injectors: [signal, http, kmsg, dcgm], kmsg_path: KMSG}
  - name: w2
    url: http://127.0.0.1:8102
    model: m
    protected: true
    faults: [kill]
  - name: w3
    url: http://127.0.0.1:8103
    model: m
    faults: [slow, net-latency, net-blackhole, xid48]
    inject: {injectors: [http, net], netproxy: http://127.0.0.1:9103}
"""


@pytest.fixture
def inventory(tmp_path: Path) -> Inventory:
    return parse_inventory(INVENTORY.replace("KMSG", str(tmp_path / "kmsg.log")))


class Recorder:
    """Injectors with every seam faked: signals, HTTP and commands are recorded."""

    def __init__(self, status: int = 200) -> None:
        self.signals: list[tuple[int, int]] = []
        self.requests: list[tuple[str, str, Any, str | None]] = []
        self.spawner = FakeSpawner()
        self.status = status

    def handle(self, request: Request) -> Reply:
        """The transport's handler: records the request, answers `status` with a JSON body."""
        assert request.timeout_s > 0
        doc = request.json() if request.body else None
        self.requests.append((request.method, request.url, doc,
                              request.headers.get("Authorization")))
        return Reply(self.status, json.dumps({"ok": self.status < 400}).encode())

    def injectors(self) -> Injectors:
        def kill(pid: int, sig: int) -> None:
            self.signals.append((pid, sig))

        return Injectors(environ={"T_TOKEN": "s3cret", "FTCTL_NETPROXY_TOKEN": "n3t"},
                         transport=MockTransport(self.handle), kill=kill, spawner=self.spawner)


def _counter(fault: str, worker: str) -> float:
    value = REGISTRY.get_sample_value("ftctl_faults_injected_total",
                                      {"fault": fault, "worker": worker})
    return value or 0.0


def test_unknown_fault_is_refused_with_a_hint(inventory: Inventory) -> None:
    """A fault outside the catalog is refused and the nearest name is suggested."""
    with pytest.raises(InvalidInput, match="did you mean 'slow'"):
        plan_injection(inventory, "w1", "slwo")


def test_protected_worker_is_refused(inventory: Inventory) -> None:
    """A protected worker is refused even for a fault in its allowlist."""
    with pytest.raises(InvalidInput, match="protected"):
        plan_injection(inventory, "w2", "kill")


def test_fault_outside_allowlist_is_refused(inventory: Inventory) -> None:
    """A catalog fault missing from the worker's allowlist is refused."""
    with pytest.raises(InvalidInput, match="allowlist"):
        plan_injection(inventory, "w1", "term")


def test_unknown_worker_is_refused(inventory: Inventory) -> None:
    """Only inventory workers can be targeted."""
    with pytest.raises(InvalidInput, match="no worker named 'w9'"):
        plan_injection(inventory, "w9", "kill")


def test_fault_without_its_injector_is_refused(inventory: Inventory) -> None:
    """net-latency on a worker whose injectors exclude `net` is refused."""
    with pytest.raises(InvalidInput, match="needs the net injector"):
        plan_injection(inventory, "w1", "net-latency")


def test_xid_effects_follow_the_catalog(inventory: Inventory) -> None:
    """xid48 crashes, xid63 only logs, xid94 ends one request (no revert), xid43 stops it."""
    crash = plan_injection(inventory, "w1", "xid48")
    assert [s.injector for s in crash.steps] == ["kmsg", "dcgm", "dcgm", "http"]
    assert crash.steps[-1].data["body"] == {"kind": "crash", "xid": 48}
    assert crash.reverts == ()
    log = plan_injection(inventory, "w1", "xid63")
    assert {s.injector for s in log.steps} == {"kmsg", "dcgm"}
    assert not log.destructive
    request = plan_injection(inventory, "w1", "xid94")
    assert request.steps[-1].data["body"] == {"kind": "contained", "xid": 94}
    assert request.reverts == ()
    hang = plan_injection(inventory, "w1", "xid43")
    assert hang.steps[-1].data == {"signal": "SIGSTOP"}
    assert hang.reverts[0].data == {"signal": "SIGCONT"}


def test_dcgm_steps_always_name_the_gpu(inventory: Inventory) -> None:
    """Every dcgmi command carries --gpuid, one per GPU of the worker."""
    plan = plan_injection(inventory, "w1", "xid48")
    argvs = [s.data["argv"] for s in plan.steps if s.injector == "dcgm"]
    assert argvs == [["dcgmi", "test", "--inject", "--gpuid", g, "-f", "230", "-v", "48"]
                     for g in ("0", "1")]


def test_dry_run_plan_names_pid_url_and_token_variable(inventory: Inventory) -> None:
    """The plan's lines name the pid, the admin URL and the token variable, never a token."""
    text = "\n".join(plan_injection(inventory, "w1", "kill").lines())
    assert "kill -KILL 4242" in text
    text = "\n".join(plan_injection(inventory, "w1", "slow",
                                    InjectOptions(delay_ms=80)).lines())
    assert 'POST http://127.0.0.1:8101/admin/fault {"kind":"slow","delay_ms":80}' in text
    assert "$T_TOKEN" in text


SIM_CLUSTER = """
cluster: local
workers:
  - name: w3
    url: http://127.0.0.1:18103
    model: ftctl-sim-tiny
    launch: {sim: {seed: 0}}
    faults: [kill]
"""


def test_a_sim_cluster_worker_is_signalled_by_the_pid_the_cluster_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launch.sim worker without process settings: inject reads the pid file
    `ftctl sim cluster` writes for it (<state dir>/<cluster>/<worker>.pid)."""
    from dynamo_ftctl.engine.launcher import cluster_pid_file

    monkeypatch.setenv("FTCTL_STATE_DIR", str(tmp_path / "state"))
    inventory = parse_inventory(SIM_CLUSTER)
    path = cluster_pid_file(inventory, inventory.worker("w3"))
    assert path == tmp_path / "state" / "local" / "w3.pid"
    path.parent.mkdir(parents=True)
    path.write_text("4343\n")
    plan = plan_injection(inventory, "w3", "kill")
    assert [s.describe() for s in plan.steps] == ["kill -KILL 4343"]


def test_a_sim_cluster_worker_without_its_pid_file_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No cluster running: the error names the pid file and who writes it (exit 2)."""
    monkeypatch.setenv("FTCTL_STATE_DIR", str(tmp_path / "state"))
    inventory = parse_inventory(SIM_CLUSTER)
    with pytest.raises(InvalidInput, match=r"w3: cannot read pid file .*local/w3\.pid: .*"
                                           r"`ftctl sim cluster` writes it"):
        plan_injection(inventory, "w3", "kill")


def test_destructive_fault_needs_yes_off_a_terminal(inventory: Inventory) -> None:
    """kill without --yes is refused off a terminal, asked on one, allowed with --yes."""
    plan = plan_injection(inventory, "w1", "kill")
    with pytest.raises(InvalidInput, match="--yes"):
        check_confirmation(plan, yes=False, interactive=False)
    assert check_confirmation(plan, yes=False, interactive=True)
    assert not check_confirmation(plan, yes=True, interactive=False)
    assert not check_confirmation(plan_injection(inventory, "w1", "slow"), yes=False,
                                  interactive=False)


def test_slow_with_duration_applies_audits_and_reverts(inventory: Inventory,
                                                       tmp_path: Path) -> None:
    """slow --duration posts the fault with the bearer token, waits, clears, audits both."""
    rec = Recorder()
    clock = FakeClock()
    before = _counter("slow", "w1")
    result = run_injection(
        plan_injection(inventory, "w1", "slow", InjectOptions(delay_ms=50, duration_s=30)),
        injectors=rec.injectors(), audit_log=tmp_path / "audit.jsonl",
        state_dir=tmp_path / "state", clock=clock,
    )
    assert result.reverted
    assert clock.sleeps == [30]
    assert [(m, b, a) for m, _, b, a in rec.requests] == [
        ("POST", {"kind": "slow", "delay_ms": 50.0}, "Bearer s3cret"),
        ("POST", {"kind": "clear"}, "Bearer s3cret"),
    ]
    audit = read_audit(tmp_path / "audit.jsonl")
    assert [(a["action"], a["what"], a["target"], a["result"]) for a in audit] == [
        ("inject", "slow", "w1", "ok"), ("revert", "slow", "w1", "ok")]
    assert "@" in audit[0]["who"]
    assert audit[0]["when"].endswith("+00:00")
    assert pending_reverts(tmp_path / "state") == []
    assert _counter("slow", "w1") == before + 1


def test_missing_token_variable_fails_before_any_request(inventory: Inventory,
                                                         tmp_path: Path) -> None:
    """An unset admin token variable is bad input (exit 2) and no request is sent."""
    rec = Recorder()
    injectors = rec.injectors()
    injectors.environ = {}
    with pytest.raises(InvalidInput, match=r"\$T_TOKEN"):
        run_injection(plan_injection(inventory, "w1", "sdc"), injectors=injectors,
                      audit_log=tmp_path / "a.jsonl", state_dir=tmp_path / "s")
    assert rec.requests == []
    assert read_audit(tmp_path / "a.jsonl")[0]["result"].startswith("failed")


def test_unreachable_worker_rolls_back_and_exits_3(inventory: Inventory, tmp_path: Path) -> None:
    """A 5xx from the admin endpoint is Unreachable; the revert runs and no record stays."""
    rec = Recorder(status=503)
    with pytest.raises(Unreachable):
        run_injection(plan_injection(inventory, "w1", "sdc"), injectors=rec.injectors(),
                      audit_log=tmp_path / "a.jsonl", state_dir=tmp_path / "s")
    assert [b for _, _, b, _ in rec.requests] == [{"kind": "sdc"}, {"kind": "clear"}]
    assert pending_reverts(tmp_path / "s") == []


def test_interrupted_wait_still_reverts(inventory: Inventory, tmp_path: Path) -> None:
    """Ctrl-C during --duration still applies the revert before leaving."""
    rec = Recorder()

    class InterruptingClock(FakeClock):
        def sleep(self, seconds: float) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_injection(plan_injection(inventory, "w1", "hang", InjectOptions(duration_s=5)),
                      injectors=rec.injectors(), audit_log=tmp_path / "a.jsonl",
                      state_dir=tmp_path / "s", clock=InterruptingClock())
    assert rec.signals == [(4242, 19), (4242, 18)]  # SIGSTOP then SIGCONT
    assert pending_reverts(tmp_path / "s") == []


def test_record_written_before_the_fault_survives_a_crash(inventory: Inventory,
                                                          tmp_path: Path) -> None:
    """An injector that dies after applying leaves a record that `revert --all` applies."""
    rec = Recorder()
    state = tmp_path / "s"
    audit = tmp_path / "a.jsonl"

    injectors = rec.injectors()
    original = injectors.execute
    calls: list[Step] = []

    def execute(step: Step) -> str:
        calls.append(step)
        if step.data.get("body") == {"kind": "clear"} and len(calls) == 2:
            raise SystemExit(1)  # the process "dies" before its revert lands
        return original(step)

    injectors.execute = execute  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        run_injection(plan_injection(inventory, "w1", "sdc", InjectOptions(duration_s=9)),
                      injectors=injectors, audit_log=audit, state_dir=state, clock=FakeClock())
    pending = pending_reverts(state)
    assert [(p["fault"], p["worker"]) for p in pending] == [("sdc", "w1")]
    result = revert_pending(all_=True, injectors=rec.injectors(), audit_log=audit,
                            state_dir=state)
    assert [r["fault"] for r in result.reverted] == ["sdc"]
    assert rec.requests[-1][2] == {"kind": "clear"}
    assert pending_reverts(state) == []
    assert read_audit(audit)[-1]["action"] == "revert"


def test_duration_less_fault_stays_pending_until_reverted(inventory: Inventory,
                                                          tmp_path: Path) -> None:
    """A fault with no --duration keeps its record; revert by id applies and removes it."""
    rec = Recorder()
    result = run_injection(plan_injection(inventory, "w1", "hang"), injectors=rec.injectors(),
                           audit_log=tmp_path / "a.jsonl", state_dir=tmp_path / "s")
    assert not result.reverted
    assert result.pending_revert is not None
    assert result.pending_revert.exists()
    with pytest.raises(InvalidInput, match="--all"):
        revert_pending(injectors=rec.injectors(), state_dir=tmp_path / "s")
    revert_pending([result.id], injectors=rec.injectors(), audit_log=tmp_path / "a.jsonl",
                   state_dir=tmp_path / "s")
    assert rec.signals[-1] == (4242, 18)
    assert not result.pending_revert.exists()


def test_kmsg_line_round_trips_through_the_gpu_parser(inventory: Inventory,
                                                      tmp_path: Path) -> None:
    """The injected Xid line parses back to the same Xid, PCI id and pid."""
    from dynamo_ftctl.gpu.kmsg import parse_xid_line

    plan = plan_injection(inventory, "w1", "xid63")
    kmsg_only = [s for s in plan.steps if s.injector == "kmsg"]
    Injectors().execute(kmsg_only[0])
    lines = (tmp_path / "kmsg.log").read_text().splitlines()
    assert len(lines) == 1
    parsed = parse_xid_line(lines[0])
    assert parsed is not None
    assert (parsed.xid, parsed.pci_bus_id, parsed.pid) == (63, "0000:3b:00", 4242)
    assert parsed.message.startswith("ECC page retirement")


def test_dcgmi_runs_with_gpuid_on_path(inventory: Inventory, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The dcgm injector runs the dcgmi found on PATH with --gpuid, field 230 and the Xid."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "dcgmi.args"
    script = bindir / "dcgmi"
    script.write_text(f"#!{sys.executable}\nimport sys\n"
                      f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    plan = plan_injection(inventory, "w1", "xid63")
    for step in plan.steps:
        if step.injector == "dcgm":
            assert Injectors().execute(step) == "ok"
    assert log.read_text().splitlines() == [
        "test --inject --gpuid 0 -f 230 -v 63", "test --inject --gpuid 1 -f 230 -v 63"]


def test_dcgmi_failure_is_unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dcgmi that exits non-zero is reported with its last line (exit 3)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "dcgmi"
    script.write_text("#!/bin/sh\necho 'Error: unable to connect to host engine' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    step = Step("dcgm", "dcgmi", {"argv": ["dcgmi", "test", "--inject", "--gpuid", "0"]})
    with pytest.raises(Unreachable, match="unable to connect"):
        Injectors().execute(step)


def test_net_faults_post_and_delete_toxics(inventory: Inventory, tmp_path: Path) -> None:
    """net-blackhole adds a toxic each way on the worker's proxy and deletes both on revert,
    each call with the fault proxy's bearer token."""
    rec = Recorder()
    run_injection(plan_injection(inventory, "w3", "net-blackhole",
                                 InjectOptions(duration_s=1)),
                  injectors=rec.injectors(), audit_log=tmp_path / "a.jsonl",
                  state_dir=tmp_path / "s", clock=FakeClock())
    assert [(m, u) for m, u, _, _ in rec.requests] == [
        ("POST", "http://127.0.0.1:9103/toxics"), ("POST", "http://127.0.0.1:9103/toxics"),
        ("DELETE", "http://127.0.0.1:9103/toxics/ftctl-net-blackhole"),
        ("DELETE", "http://127.0.0.1:9103/toxics/ftctl-net-blackhole-up"),
    ]
    assert {b["direction"] for _, _, b, _ in rec.requests[:2] if "direction" in b} == {
        "upstream"}
    assert {auth for _, _, _, auth in rec.requests} == {"Bearer n3t"}


def test_net_faults_need_the_fault_proxy_token(inventory: Inventory, tmp_path: Path) -> None:
    """An unset netproxy token variable is bad input naming it; no toxic is sent."""
    rec = Recorder()
    injectors = rec.injectors()
    injectors.environ = {"T_TOKEN": "s3cret"}
    plan = plan_injection(inventory, "w3", "net-blackhole", InjectOptions(duration_s=1))
    assert "(Authorization: Bearer $FTCTL_NETPROXY_TOKEN)" in plan.steps[0].describe()
    with pytest.raises(InvalidInput, match=r"\$FTCTL_NETPROXY_TOKEN"):
        run_injection(plan, injectors=injectors, audit_log=tmp_path / "a.jsonl",
                      state_dir=tmp_path / "s", clock=FakeClock())
    assert rec.requests == []


def test_list_covers_catalog_and_xids() -> None:
    """`--list` holds every catalog fault and one entry per Xid with its effect."""
    names = {f["name"]: f for f in list_faults().faults}
    assert {"kill", "hang", "net-reset", "overload"} <= set(names)
    assert "effect: crash" in names["xid48"]["summary"]
    assert names["xid63"]["destructive"] is False


def test_overload_plans_a_bounded_background_load_and_its_stop(inventory: Inventory,
                                                               tmp_path: Path) -> None:
    """overload: one load step against the worker's URL with --rate/--concurrency, bounded by the
    duration plus a margin; the revert stops the process named by the same pid file."""
    plan = plan_injection(inventory, "w1", "overload", InjectOptions(
        rate=50, concurrency=8, duration_s=10, state_dir=tmp_path))
    (start,), (stop,) = plan.steps, plan.reverts
    assert start.injector == stop.injector == "load"
    assert start.target == stop.target
    assert Path(start.target).parent == tmp_path / "loads"
    argv = start.data["argv"]
    assert argv[1:3] == ["-m", "dynamo_ftctl.faults.overload"]
    assert argv[argv.index("--url") + 1] == "http://127.0.0.1:8101"
    assert (argv[argv.index("--rate") + 1], argv[argv.index("--concurrency") + 1],
            argv[argv.index("--bound") + 1]) == ("50", "8", "15")
    assert stop.data == {"action": "stop"}
    assert not plan.destructive
    with pytest.raises(InvalidInput, match="not in worker w3's faults allowlist"):
        plan_injection(inventory, "w3", "overload")


def test_stop_overload_never_signals_a_process_that_is_not_the_load(tmp_path: Path) -> None:
    """A pid file naming another process (a reused pid) or none at all stops nothing."""
    from dynamo_ftctl.faults.overload import stop_overload

    assert "pid file gone" in stop_overload(tmp_path / "missing.json")
    pid_file = tmp_path / "other.json"
    pid_file.write_text(json.dumps({"pid": os.getpid()}))
    assert "already ended" in stop_overload(pid_file)
    assert not pid_file.exists()
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    with pytest.raises(Unreachable, match="unreadable load pid file"):
        stop_overload(garbage)


def test_stop_overload_waits_for_an_exiting_load_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGTERMed load whose command line already reads empty (its memory torn down, its
    sockets not yet closed) has not ended: the revert waits until it is a zombie."""
    import threading

    from dynamo_ftctl import procfs
    from dynamo_ftctl.faults import overload

    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)

    def stat(state: str) -> str:
        return f"4242 (python) {state} 1 4242 4242" + " 0" * 15 + " 777 0 0\n"

    (proc / "stat").write_text(stat("S"))
    (proc / "cmdline").write_bytes(b"python\0-m\0dynamo_ftctl.faults.overload\0--url\0x\0")
    ended = threading.Event()
    signals: list[int] = []

    def finish() -> None:
        # Set first: the revert may return the moment it reads "Z", before a line after
        # the write would run (a race CI hit).
        ended.set()
        (proc / "stat").write_text(stat("Z"))

    def fake_kill(pid: int, sig: int) -> None:
        assert pid == 4242
        signals.append(sig)
        (proc / "cmdline").write_bytes(b"")
        (proc / "stat").write_text(stat("R"))
        threading.Timer(0.3, finish).start()

    monkeypatch.setattr(procfs, "PROC", tmp_path / "proc")
    pid_file = tmp_path / "load.json"
    pid_file.write_text(json.dumps({"pid": 4242}))
    assert overload.stop_overload(pid_file, kill=fake_kill) == "stopped load pid 4242 (SIGTERM)"
    assert ended.is_set()
    assert signals == [signal.SIGTERM]
    assert not pid_file.exists()


def test_a_load_that_cannot_start_or_dies_at_once_is_a_failed_injection(tmp_path: Path) -> None:
    """start_overload: a spawn that fails, or a load that exits at once, is Unreachable."""
    from dynamo_ftctl.faults.overload import start_overload
    from dynamo_ftctl.process import FakeChild

    with pytest.raises(Unreachable, match="cannot start the load process"):
        start_overload(tmp_path / "a.json", ["load"],
                       spawner=FakeSpawner(fail=FileNotFoundError(2, "No such file")))

    class DiesAtOnce(FakeSpawner):
        def spawn(self, argv: Sequence[str], **kwargs: Any) -> FakeChild:
            child = super().spawn(argv, **kwargs)
            child.finish(2)
            (tmp_path / "b.log").write_text("error: bad URL\n")
            return child

    spawner = DiesAtOnce()
    with pytest.raises(Unreachable, match="exited at once with code 2: error: bad URL"):
        start_overload(tmp_path / "b.json", ["load", "--url", "x"], spawner=spawner)
    (child,) = spawner.spawned
    assert child.group  # its own session: the load outlives the injector
    assert child.stdout_sink == child.stderr_sink == tmp_path / "b.log"
