"""Drill scenarios validate with file:line errors; `ftctl drill` exits 2 on an invalid one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_ftctl.drill.scenario import load_scenario
from dynamo_ftctl.errors import InventoryError

DRILLS = Path(__file__).resolve().parents[3] / "drills"

INVENTORY = """cluster: t
workers:
  - name: w1
    url: http://127.0.0.1:8101
    model: m
    faults: [kill, sdc]
  - name: w2
    url: http://127.0.0.1:8102
    model: m
    protected: true
    faults: [kill]
"""

GOOD = """title: t
inventory: inv.yaml
hypothesis:
  probes:
    - {name: up, kind: workers_healthy}
method:
  timeline:
    - {at_s: 1, fault: kill, worker: w1}
"""


def _write(tmp_path: Path, scenario: str) -> Path:
    (tmp_path / "inv.yaml").write_text(INVENTORY)
    path = tmp_path / "s.yaml"
    path.write_text(scenario)
    return path


@pytest.mark.parametrize("name", ["worker-crash", "xid48", "sdc", "hang", "network", "overload"])
def test_shipped_drills_are_valid(name: str) -> None:
    """Every shipped drill validates against its local inventory."""
    scenario, inventory = load_scenario(DRILLS / f"{name}.yaml")
    assert scenario.title
    assert all(w.launch is not None for w in inventory.workers)


def test_good_scenario_loads(tmp_path: Path) -> None:
    """A minimal scenario loads with default rollbacks."""
    scenario, inventory = load_scenario(_write(tmp_path, GOOD))
    assert inventory.cluster == "t"
    assert [r.action for r in scenario.rollbacks] == ["revert_faults", "restart_workers"]


@pytest.mark.parametrize(("old", "new", "where"), [
    ("kind: workers_healthy", "kind: workers_happy", "s.yaml:5: hypothesis.probes[0].kind"),
    ("worker: w1}", "worker: w9}", "s.yaml:8: method.timeline[0].worker: no worker named 'w9'"),
    ("fault: kill, worker: w1", "fault: sdc, worker: w2",
     "s.yaml:8: method.timeline[0].worker: worker w2 is protected"),
    ("fault: kill, worker: w1", "fault: hang, worker: w1",
     "s.yaml:8: method.timeline[0].fault: fault 'hang' is not in worker w1's allowlist"),
    ("fault: kill, worker: w1", "fault: kil, worker: w1", "s.yaml:8: method.timeline[0].fault"),
    ("{at_s: 1, fault: kill, worker: w1}", "{at_s: 1}", "s.yaml:8: method.timeline[0].fault"),
    ("title: t", "title: t\ntitel: x", "s.yaml:2: titel"),
    ("worker: w1}", "worker: w1, witness_tokens: 4}",
     "s.yaml:8: method.timeline[0].witness_tokens: witness_tokens needs method.witness"),
    ("{name: up, kind: workers_healthy}", "{name: e, kind: error_rate}",
     "s.yaml:5: hypothesis.probes[0].max: a error_rate probe needs a tolerance"),
])
def test_bad_scenarios_name_file_line_and_key(tmp_path: Path, old: str, new: str,
                                              where: str) -> None:
    """Each mistake is one error naming the file, the line and the key."""
    assert old in GOOD
    with pytest.raises(InventoryError) as caught:
        load_scenario(_write(tmp_path, GOOD.replace(old, new)))
    assert where in str(caught.value)


def test_bad_scenario_exits_2_from_the_cli(tmp_path: Path) -> None:
    """`ftctl drill` on an invalid scenario exits 2 with one error line and starts nothing."""
    path = _write(tmp_path, GOOD.replace("worker: w1}", "worker: w9}"))
    done = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "drill", str(path), "--local",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert "s.yaml:8: method.timeline[0].worker" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("text", "where"), [
    (GOOD.replace("kind: workers_healthy}", "kind: shed, priority: best_effort}"),
     "s.yaml:5: hypothesis.probes[0].kind"),
    (GOOD.replace("method:\n", "method:\n  load: {rate: 1}\n  loads: [{rate: 1}]\n"),
     "s.yaml:8: method.loads"),
    (GOOD.replace("timeline:\n", "timeline:\n    - {at_s: 0, probe: {name: s, kind: shed}}\n"),
     "s.yaml:8: method.timeline[0].probe.priority"),
    (GOOD.replace("method:\n", "method:\n  load: {rate: 1, users: 8}\n"),
     "s.yaml:7: method.load.users"),
])
def test_overload_scenario_errors_name_file_line_and_key(tmp_path: Path, text: str,
                                                         where: str) -> None:
    """A shed probe in the hypothesis, load and loads together, a shed probe without a
    priority, a load with both a rate and users: each is a file:line: key error."""
    with pytest.raises(InventoryError) as info:
        load_scenario(_write(tmp_path, text))
    assert where in str(info.value)
