"""launch.command: placeholders, ${VAR}s and their one-line errors; stopping a command's group."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl.drill.command_worker import CommandWorker, expand_command, start_command_workers
from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.inventory import Inventory, parse_inventory
from dynamo_ftctl.process import FakeChild, FakeSpawner


def _inventory(launch: str) -> Inventory:
    return parse_inventory(f"""
cluster: t
workers:
  - name: v1
    url: http://127.0.0.1:9
    model: tiny
    launch: {launch}
""", "inv.yaml")


def test_placeholders_and_variables_are_filled() -> None:
    """{host}, {port}, {model} and ${VAR} (argv and env) become their values."""
    inv = _inventory("{command: ['${PY}', --port, '{port}', --host, '{host}', '{model}'], "
                     "env: {A: 'x${PY}'}}")
    argv, env = expand_command(inv.workers[0], host="127.0.0.1", port=4242,
                               environ={"PY": "/v/python"}, where="inv.yaml: workers[0].launch")
    assert argv == ["/v/python", "--port", "4242", "--host", "127.0.0.1", "tiny"]
    assert env == {"A": "x/v/python"}


def test_an_unset_variable_names_its_key() -> None:
    """An unset ${VAR} is one line naming the file and key (exit 2)."""
    inv = _inventory("{command: [python, '${FTCTL_NOPE}']}")
    with pytest.raises(InvalidInput, match=r"inv.yaml: workers\[0\].launch.command\[1\]: "
                                           r"\$\{FTCTL_NOPE\} is not set") as caught:
        expand_command(inv.workers[0], host="h", port=1, environ={}, where=
                       "inv.yaml: workers[0].launch")
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(("launch", "says"), [
    ("{command: [x, '{prot}']}", "workers[0].launch.command[1]: unknown placeholder {prot}"),
    ("{command: [x], sim: {}}", "workers[0].launch.command: give sim or command, not both"),
    ("{command: [x], health_path: health}", "workers[0].launch.health_path: must start"),
    ("{command: []}", "workers[0].launch.command"),
])
def test_bad_launch_commands_are_refused_naming_the_key(launch: str, says: str) -> None:
    """A bad launch.command is an inventory error naming file, line and key."""
    with pytest.raises(InventoryError) as caught:
        _inventory(launch)
    assert says in str(caught.value)
    assert str(caught.value).startswith("inv.yaml:")


def _two_workers() -> Inventory:
    return parse_inventory("""
cluster: t
workers:
  - name: v1
    url: http://127.0.0.1:9
    model: tiny
    launch: {command: [engine-one, '{port}']}
  - name: v2
    url: http://127.0.0.1:9
    model: tiny
    launch: {command: [engine-two, '{port}']}
""", "inv.yaml")


def test_stop_terminates_the_group_then_kills_what_is_left(tmp_path: Path) -> None:
    """stop: SIGCONT and SIGTERM to the whole group, a wait of the deadline, then SIGKILL."""
    fake = FakeSpawner(exits_on={})  # an engine that ignores SIGTERM
    inv = _two_workers()
    worker = CommandWorker(name="v1", url="http://127.0.0.1:9", model="tiny",
                           launch=inv.workers[0].launch,  # type: ignore[arg-type]
                           argv=["engine-one"], env={}, log=tmp_path / "v1.log",
                           child=fake.spawn(["engine-one"], group=True), spawner=fake)
    worker.stop(timeout_s=3.0)
    child = fake.spawned[0]
    assert child.signals == [(signal.SIGCONT, True), (signal.SIGTERM, True),
                             (signal.SIGKILL, True)]
    assert child.waits[0] == 3.0
    assert not worker.alive


def test_a_command_that_cannot_start_stops_the_ones_started(tmp_path: Path) -> None:
    """All or nothing: the second command failing to start stops the first, group-wide."""

    class FailSecond(FakeSpawner):
        def spawn(self, argv: Sequence[str], **kwargs: Any) -> FakeChild:
            if self.spawned:
                raise FileNotFoundError(2, "No such file or directory")
            return super().spawn(argv, **kwargs)

    fake = FailSecond()
    inv = _two_workers()
    workers = [(w, "127.0.0.1", 4000 + i, f"inv.yaml: workers[{i}].launch")
               for i, w in enumerate(inv.workers)]
    with pytest.raises(InvalidInput, match="cannot start engine-two: No such file"):
        start_command_workers(workers, log_dir=tmp_path, environ={}, spawner=fake)
    (first,) = fake.spawned
    assert first.argv == ["engine-one", "4000"]
    assert first.group
    assert first.sent[:2] == [signal.SIGCONT, signal.SIGTERM]
    assert first.stdout_sink == tmp_path / "v1.log"
