"""launch.command: placeholders, ${VAR}s and their one-line errors."""

from __future__ import annotations

import pytest

from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.faults.command_worker import expand_command
from dynamo_ftctl.inventory import Inventory, parse_inventory


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
