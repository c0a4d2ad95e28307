"""Global options anywhere on the line (`-i`, `--json`, `--debug`), `--`, and the
missing-inventory error: parsing in-process, exit codes through real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

from dynamo_ftctl.cli.main import COMMANDS
from dynamo_ftctl.cli.main import app as root_app

ROOT = Path(__file__).resolve().parents[3]
LOCAL = ROOT / "examples" / "local.yaml"
SET = ROOT / "canaries" / "ftctl-sim-tiny.yaml"
GLOBAL_SPELLINGS = ("-i", "--inventory", "--json", "--debug")


def ftctl(*args: str, cwd: Path, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "NO_COLOR": "1", "FTCTL_INVENTORY": ""}
    full_env.pop("FTCTL_NO_FAST_PATH", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True,
                          text=True, timeout=120, env=full_env, cwd=cwd, check=False)


def _unreachable_inventory(tmp_path: Path) -> Path:
    """One worker on the discard port (nothing listens: refused at once)."""
    path = tmp_path / "inv.yaml"
    path.write_text(f"cluster: t\nworkers:\n  - name: w3\n    url: http://127.0.0.1:9\n"
                    f"    model: ftctl-sim-tiny\ncanary:\n  set: {SET}\n  timeout_s: 2\n")
    return path


def _every_command() -> list[tuple[str, click.Command]]:
    """Each command under the root, as `ftctl` builds it (group modules imported)."""
    root = typer.main.get_command(root_app)
    found: list[tuple[str, click.Command]] = []
    with click.Context(root) as ctx:
        for name in COMMANDS:
            stack = [(name, root.get_command(ctx, name))]
            while stack:
                path, command = stack.pop()
                assert command is not None, path
                found.append((path, command))
                if isinstance(command, click.Group):
                    stack += [(f"{path} {sub}", c) for sub, c in command.commands.items()]
    return found


def test_every_command_takes_the_global_options_with_their_meaning() -> None:
    """Each command accepts -i/--inventory/--json/--debug; where it defines one itself, it is
    the same kind (flag or value) and says it means the root's."""
    root = typer.main.get_command(root_app)
    root_opts = {o: p for p in root.params if isinstance(p, click.Option) for o in p.opts}
    for path, command in _every_command():
        opts = {o: p for p in command.params if isinstance(p, click.Option) for o in p.opts}
        for spelling in GLOBAL_SPELLINGS:
            assert spelling in opts, (path, spelling)
            own = opts[spelling]
            assert own.is_flag == root_opts[spelling].is_flag, (path, spelling)
            if own.hidden:  # inherited from the root
                continue
            if spelling == "--json":
                assert own.help == root_opts["--json"].help, path
            else:
                assert "root -i" in (own.help or ""), (path, spelling, own.help)


def test_the_issue_line_probes_with_the_inventory_given_after_canary(tmp_path: Path) -> None:
    """`ftctl canary --worker w3 -i inv.yaml`: the fast path and the full CLI both probe."""
    inventory = _unreachable_inventory(tmp_path)
    for env in ({}, {"FTCTL_NO_FAST_PATH": "1"}):
        proc = ftctl("canary", "--worker", "w3", "-i", str(inventory), "--no-state",
                     "--json", cwd=tmp_path, env=env)
        assert proc.returncode == 3, (env, proc.stderr)
        assert json.loads(proc.stdout)["workers"][0]["worker"] == "w3"


@pytest.mark.parametrize("args", [
    ("inventory", "show", "-i", str(LOCAL), "--json"),
    ("inventory", "show", "--json", "--inventory", str(LOCAL)),
    ("inventory", "show", f"--inventory={LOCAL}", "--json"),
    ("-i", "absent.yaml", "inventory", "show", "-i", str(LOCAL), "--json"),  # the later wins
    ("--json", "inventory", "-i", str(LOCAL), "show"),                      # between groups
])
def test_inventory_and_json_after_the_subcommand(args: tuple[str, ...], tmp_path: Path) -> None:
    """-i and --json work before, between and after subcommands; the last -i wins."""
    proc = ftctl(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cluster"] == "local"


def test_debug_after_the_subcommand_shows_the_traceback(tmp_path: Path) -> None:
    """`--debug` at the end of the line adds the traceback, as before the subcommand."""
    proc = ftctl("inventory", "show", "-i", "absent.yaml", "--debug", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
    assert proc.stderr.rstrip().endswith("absent.yaml: no such file")


def test_lock_owner_takes_debug_and_json_after_its_options(tmp_path: Path) -> None:
    """`ftctl lock owner --path p --debug --json` parses and answers (free: exit 1)."""
    proc = ftctl("lock", "owner", "--path", str(tmp_path / "x.lock"), "--debug", "--json",
                 cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["held"] is False


@pytest.mark.parametrize("separator", [["--"], []])
def test_a_command_after_the_lock_keeps_its_own_options(
    separator: list[str], tmp_path: Path,
) -> None:
    """After `--` (or the command's first word) -i, --json and --debug go to the command."""
    proc = ftctl("lock", "acquire", "--path", str(tmp_path / "x.lock"), *separator,
                 sys.executable, "-c", "import sys; print(sys.argv[1:])",
                 "-i", "foo", "--json", "--debug", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "['-i', 'foo', '--json', '--debug']\n"


def test_an_unknown_option_after_the_subcommand_is_still_a_usage_error(tmp_path: Path) -> None:
    """Only the global options are accepted everywhere: anything else still exits 2."""
    proc = ftctl("inventory", "show", "--nope", cwd=tmp_path)
    assert proc.returncode == 2
    assert "No such option: --nope" in proc.stderr


@pytest.mark.parametrize("args", [("inventory", "show"), ("canary", "-w", "w1"),
                                  ("proxy",), ("inject", "kill", "-w", "w1", "--dry-run")])
def test_no_inventory_says_how_to_name_one(args: tuple[str, ...], tmp_path: Path) -> None:
    """No -i, no $FTCTL_INVENTORY, no ./ftctl.yaml: one line naming -i and the variable."""
    proc = ftctl(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == ("error: ftctl.yaml: no such file, and no inventory named: give -i "
                           "PATH (before or after the command) or set FTCTL_INVENTORY=PATH\n")


def test_a_named_inventory_that_is_missing_keeps_the_plain_error(tmp_path: Path) -> None:
    """-i or $FTCTL_INVENTORY naming a missing file: the file is named, no hint needed."""
    for args, env in ((("-i", "typo.yaml", "inventory", "show"), {}),
                      (("inventory", "show"), {"FTCTL_INVENTORY": "typo.yaml"})):
        proc = ftctl(*args, cwd=tmp_path, env=env)
        assert proc.returncode == 2
        assert proc.stderr == "error: typo.yaml: no such file\n"
