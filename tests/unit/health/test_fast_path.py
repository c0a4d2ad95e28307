"""The one-shot probe's fast path (`cli/probe.py`): same answers as the full CLI, without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

from dynamo_ftctl.cli import canary as canary_cli
from dynamo_ftctl.cli.main import app as root_app
from dynamo_ftctl.cli.probe import (
    FAST_FLAGS,
    FAST_OPTIONS,
    ROOT_FLAGS,
    ROOT_OPTIONS,
    parse_one_shot,
)

ROOT = Path(__file__).resolve().parents[3]
SET = str(ROOT / "canaries" / "ftctl-sim-tiny.yaml")
INVENTORY = str(ROOT / "examples" / "local.yaml")


def _options(app: typer.Typer) -> dict[str, click.Option]:
    command = typer.main.get_command(app)
    return {name: p for p in command.params if isinstance(p, click.Option)
            for name in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize(("fast_options", "fast_flags", "app"), [
    (ROOT_OPTIONS, ROOT_FLAGS, root_app),
    (FAST_OPTIONS, FAST_FLAGS, canary_cli.app),
])
def test_fast_spellings_exist_in_the_full_cli_with_the_same_kind(
    fast_options: dict[str, str], fast_flags: dict[str, str], app: typer.Typer,
) -> None:
    """Every option the fast path accepts is the full CLI's, as a flag or as a value alike."""
    full = _options(app)
    for name in fast_options:
        assert name in full, name
        assert not full[name].is_flag, name
    for name in fast_flags:
        assert name in full, name
        assert full[name].is_flag, name
    if "--worker" in fast_options:
        assert full["--worker"].multiple


def test_every_other_canary_option_goes_to_the_full_cli() -> None:
    """An option of `ftctl canary` the fast path does not know hands the whole line over."""
    others = set(_options(canary_cli.app)) - set(FAST_OPTIONS) - set(FAST_FLAGS)
    assert {"--watch", "--listen"} <= others
    for name in others:
        assert parse_one_shot(["canary", "--url", "http://h", name, "x"]) is None, name


@pytest.mark.parametrize("argv", [
    [],
    ["--version"],
    ["canary", "--help"],
    ["canary", "-h"],
    ["canary", "record", "-w", "w1"],
    ["canary", "--watch"],
    ["inventory", "check"],
    ["--bogus", "canary", "--all"],
    ["canary", "--url"],                       # a value is missing
    ["canary", "--url", "--json"],
    ["canary", "--timeout", "0", "--all"],     # out of the option's range: typer says so
    ["canary", "--timeout", "soon", "--all"],
    ["canary", "--timeout", "nan", "--all"],
    ["canary", "--all=yes"],
    ["canary", "--all", "--", "x"],
])
def test_anything_else_is_left_to_the_full_cli(argv: list[str]) -> None:
    """Help, subcommands, misplaced or malformed options: the fast path declines."""
    assert parse_one_shot(argv) is None


def test_one_shot_spellings_parse_to_probe_once_keywords() -> None:
    """Root and command options, `=` forms, repeats: what the typer command would pass."""
    assert parse_one_shot(["--debug", "-i", "inv.yaml", "--json", "canary", "-w", "a",
                           "--worker=b", "--set", "s.yaml", "--timeout=0.5",
                           "--state-file", "st.json", "--no-state"]) == {
        "debug": True, "inventory": Path("inv.yaml"), "as_json": True, "workers": ["a", "b"],
        "set_path": Path("s.yaml"), "timeout_s": 0.5, "state_file": Path("st.json"),
        "use_state": False,
    }
    assert parse_one_shot(["canary", "--url", "http://h:1", "--url", "http://h:2"]) == {
        "workers": [], "url": "http://h:2", "use_state": True,
    }
    assert parse_one_shot(["--inventory=x.yaml", "canary", "--all", "--json"]) == {
        "workers": [], "inventory": Path("x.yaml"), "all_workers": True, "as_json": True,
        "use_state": True,
    }


def test_root_options_after_canary_parse_as_the_full_cli_takes_them() -> None:
    """-i and --debug after `canary` (as the full CLI accepts them); the last -i wins."""
    assert parse_one_shot(["-i", "a.yaml", "canary", "--worker", "w3", "-i", "b.yaml",
                           "--debug"]) == {
        "workers": ["w3"], "inventory": Path("b.yaml"), "debug": True, "use_state": True,
    }


def test_root_options_are_on_the_canary_command_the_root_builds() -> None:
    """The full CLI's `canary` takes the root's -i/--inventory and --debug (hidden) too."""
    command = typer.main.get_command(root_app)
    with click.Context(command) as ctx:
        canary = command.get_command(ctx, "canary")
    assert canary is not None
    full = {name: p for p in canary.params if isinstance(p, click.Option) for name in p.opts}
    for name in ROOT_OPTIONS:
        assert not full[name].is_flag, name
    for name in ROOT_FLAGS:
        assert full[name].is_flag, name


def _run(*args: str, fast: bool, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "FTCTL_INVENTORY": ""}
    env.pop("FTCTL_NO_FAST_PATH", None)
    if not fast:
        env["FTCTL_NO_FAST_PATH"] = "1"
    return subprocess.run([sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True,
                          text=True, timeout=60, check=False, cwd=cwd, env=env)


@pytest.mark.parametrize("argv", [
    ["canary", "--set", SET],                                         # no target: 2
    ["canary", "--url", "ftp://h", "--set", SET],                     # bad URL: 2
    ["canary", "--url", "http://127.0.0.1:9", "--set", "missing.yaml"],  # no set file: 2
    ["-i", INVENTORY, "canary", "-w", "nope"],                        # unknown worker: 2
    ["-i", "missing.yaml", "canary", "--all"],                        # no inventory: 2
    ["canary", "-w", "nope", "-i", INVENTORY],                        # -i after: 2
    ["canary", "--all"],                      # none named, no ./ftctl.yaml: 2 with the hint
    ["canary", "--url", "http://127.0.0.1:9", "--set", SET, "--no-state"],  # refused: 3
    ["--json", "canary", "--url", "http://127.0.0.1:9", "--set", SET, "--no-state"],
    ["canary", "--url", "http://127.0.0.1:9", "--set", SET, "--no-state", "--json"],
])
def test_fast_and_full_cli_answer_alike(argv: list[str], tmp_path: Path) -> None:
    """Exit code, stdout and stderr match the full CLI's (timings aside)."""
    fast, full = (_run(*argv, fast=f, cwd=tmp_path) for f in (True, False))

    def mask(text: str) -> str:
        return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)

    assert fast.returncode == full.returncode
    assert fast.returncode in (2, 3)
    assert mask(fast.stdout) == mask(full.stdout)
    assert fast.stderr == full.stderr


def test_fast_path_skips_the_cli_framework(tmp_path: Path) -> None:
    """A one-shot probe through the console script imports neither click nor typer."""
    code = (
        "import sys\n"
        "from dynamo_ftctl.cli.entry import main\n"
        f"rc = main(['canary', '--url', 'http://127.0.0.1:9', '--set', {SET!r}, '--no-state'])\n"
        "print(rc, sorted(m for m in ('click', 'typer') if m in sys.modules), file=sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FTCTL_NO_FAST_PATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=tmp_path, env=env)
    assert proc.stderr.strip().splitlines()[-1] == "3 []"


def _console(tmp_path: Path, *argv: str, setup: str = "") -> subprocess.CompletedProcess[str]:
    """`entry.console()` in a fresh interpreter, as the `ftctl` script runs it; an atexit
    hook reports on stderr whether the collector is on and what was imported."""
    code = (
        "import atexit, gc, sys\n"
        f"{setup}\n"
        "def report():\n"
        "    seen = sorted(m for m in ('click', 'typer', 'typing_extensions', 'inspect',\n"
        "                              'socket', 'encodings.idna')\n"
        "                  if m in sys.modules)\n"
        "    print('gc', gc.isenabled(), seen, file=sys.stderr)\n"
        "atexit.register(report)\n"
        f"sys.argv = ['ftctl', *{list(argv)!r}]\n"
        "from dynamo_ftctl.cli.entry import console\n"
        "sys.exit(console())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FTCTL_NO_FAST_PATH"}
    env["FTCTL_INVENTORY"] = ""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=tmp_path, env=env)


def test_console_probe_starts_and_ends_lean(tmp_path: Path) -> None:
    """The console script's one-shot probe: no collector, none of the costly imports (the
    socket module, the IDNA codec, typing_extensions and its inspect), and a quick exit
    that still runs atexit hooks and flushes the report."""
    proc = _console(tmp_path, "canary", "--url", "http://127.0.0.1:9", "--set", SET,
                    "--no-state")
    assert proc.returncode == 3, proc.stderr
    assert "UNREACHABLE" in proc.stdout
    assert proc.stdout.endswith("\n")
    assert proc.stderr.strip().splitlines()[-1] == "gc False []"


def test_console_hands_other_canary_commands_to_the_full_cli_with_the_collector_on(
    tmp_path: Path,
) -> None:
    proc = _console(tmp_path, "canary", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--watch" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gc True ")
    assert "typer" in last


def test_quick_exit_runs_atexit_hooks_then_flushes_stdio(tmp_path: Path) -> None:
    code = (
        "import atexit, sys\n"
        "from dynamo_ftctl.cli.entry import _quick_exit\n"
        "atexit.register(lambda: sys.stdout.write(' and the hook'))\n"
        "sys.stdout.write('buffered')\n"
        "sys.stderr.write('err')\n"
        "_quick_exit(5)\n"
        "sys.stdout.write('never')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (5, "buffered and the hook", "err")


@pytest.mark.parametrize("max_tokens", ["lots", "0"])  # a type, an Annotated constraint
def test_msgspec_without_typing_extensions_validates_sets_alike(
    max_tokens: str, tmp_path: Path,
) -> None:
    """msgspec imported lean (as the console script does) gives the same file:line errors."""
    from dynamo_ftctl.errors import InventoryError
    from dynamo_ftctl.health.canaryset import load_canary_set

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: m\nprompts:\n- name: p\n  prompt: hi\n  max_tokens: {max_tokens}\n")
    with pytest.raises(InventoryError) as caught:
        load_canary_set(bad)
    assert "typing_extensions" in sys.modules  # this process: msgspec saw it
    proc = _console(tmp_path, "canary", "--url", "http://127.0.0.1:9", "--set", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == f"error: {caught.value}"
    assert proc.stderr.strip().splitlines()[-1] == "gc False []"
