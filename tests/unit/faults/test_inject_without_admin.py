"""Planning faults for an engine without an admin API (vLLM): process groups and Xids."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dynamo_ftctl.errors import InvalidInput, Unreachable
from dynamo_ftctl.faults.inject import plan_injection
from dynamo_ftctl.faults.injectors import Injectors, Step
from dynamo_ftctl.inventory import Inventory, parse_inventory


def _inventory(pid: int, *, injectors: str = "[signal, kmsg]", group: bool = True) -> Inventory:
    return parse_inventory(f"""
cluster: t
workers:
  - name: v1
    url: http://127.0.0.1:9
    model: m
    process: {{pid: {pid}, group: {str(group).lower()}}}
    faults: [kill, hang, slow, xid48, xid43, xid94]
    inject: {{injectors: {injectors}, kmsg_path: /tmp/never-written}}
""")


@pytest.fixture
def leader() -> Iterator[int]:
    """A sleeping child in a session of its own: it leads its process group."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_group_signal_goes_to_the_process_group(leader: int) -> None:
    """With process.group, kill signals -PGID and the dry run says `kill -KILL -- -PGID`."""
    plan = plan_injection(_inventory(leader), "v1", "kill")
    assert plan.steps[0].describe() == f"kill -KILL -- -{leader}"
    sent: list[tuple[int, int]] = []
    outcome = Injectors(kill=lambda pid, sig: sent.append((pid, sig))).execute(plan.steps[0])
    assert sent == [(-leader, 9)]
    assert outcome == f"sent SIGKILL to process group {leader}"


def test_a_pid_that_leads_no_group_is_refused() -> None:
    """process.group on a pid outside its own group (this test's) is refused, naming both."""
    if os.getpgid(0) == os.getpid():
        pytest.skip("this test process leads its own group")
    with pytest.raises(InvalidInput, match="does not lead a process group"):
        plan_injection(_inventory(os.getpid()), "v1", "kill")


def test_a_vanished_group_is_unreachable() -> None:
    """Signalling a group that no longer exists is Unreachable (exit 3), naming the group."""
    injectors = Injectors(kill=lambda pid, sig: (_ for _ in ()).throw(ProcessLookupError()))
    with pytest.raises(Unreachable, match="no process group 4242"):
        injectors.execute(Step("signal", "4242", {"signal": "SIGKILL", "group": True}))


def test_xid48_by_signal_logs_the_line_then_kills(leader: int) -> None:
    """xid48 without an admin API: the Xid line to the kernel log, then SIGKILL."""
    plan = plan_injection(_inventory(leader), "v1", "xid48")
    assert [s.injector for s in plan.steps] == ["kmsg", "signal"]
    assert plan.steps[1].data == {"signal": "SIGKILL", "group": True}
    assert plan.reverts == ()


def test_xid43_by_signal_stops_until_the_revert(leader: int) -> None:
    """xid43 (a hang Xid) without an admin API: the line, SIGSTOP, and SIGCONT on revert."""
    plan = plan_injection(_inventory(leader), "v1", "xid43")
    assert [s.data.get("signal") for s in plan.steps] == [None, "SIGSTOP"]
    assert [s.data["signal"] for s in plan.reverts] == ["SIGCONT"]


@pytest.mark.parametrize(("fault", "injectors", "says"), [
    ("xid48", "[signal]", "allow kmsg in inject.injectors"),
    ("xid43", "[signal]", "or inject 'hang'"),
    ("xid94", "[signal, kmsg]", "only the engine's admin API can do that"),
    ("slow", "[signal, kmsg]", "needs the http injector"),
])
def test_faults_an_engine_without_admin_api_cannot_show_are_refused(
    leader: int, fault: str, injectors: str, says: str,
) -> None:
    """An Xid with no log injector, a contained Xid or an admin fault: one line, exit 2."""
    with pytest.raises(InvalidInput, match=says) as caught:
        plan_injection(_inventory(leader, injectors=injectors), "v1", fault)
    assert "\n" not in str(caught.value)
    assert caught.value.exit_code == 2


def test_group_is_false_by_default() -> None:
    """Without process.group, a signal goes to the pid alone, as before."""
    inv = _inventory(4242, group=False)
    assert plan_injection(inv, "v1", "kill").steps[0].describe() == "kill -KILL 4242"
