"""The root command: lazy groups, global options, exit codes, start-up weight, man pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl import __version__
from dynamo_ftctl.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[3]
LOCAL = ROOT / "examples" / "local.yaml"
HEAVY = ("torch", "httpx", "aiohttp", "uvicorn", "starlette", "matplotlib", "pynvml", "prometheus_client")


def ftctl(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True, text=True,
        timeout=120, env=full_env, cwd=cwd, check=False,
    )


def imported_modules(*args: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dynamo_ftctl", *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_version() -> None:
    """--version prints the version and exits 0."""
    proc = ftctl("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"ftctl {__version__}\n"


def test_help_lists_every_group_without_importing_them() -> None:
    """--help lists each group with its one-line help and imports no heavy library."""
    proc = ftctl("--help")
    assert proc.returncode == 0
    for name, (_, help_) in COMMANDS.items():
        assert name in proc.stdout
        assert help_.split()[0] in proc.stdout
    loaded = imported_modules("--help")
    assert not loaded & set(HEAVY), loaded & set(HEAVY)
    assert "pydantic" not in loaded or "pydantic" in imported_modules("--version") | {"pydantic"}


def test_version_imports_almost_nothing() -> None:
    """--version answers before the CLI framework loads."""
    loaded = imported_modules("--version")
    assert "typer" not in loaded
    assert not loaded & set(HEAVY)


def test_every_group_has_help() -> None:
    """Each registered group loads and answers --help with exit 0."""
    for name in COMMANDS:
        proc = ftctl(name, "--help")
        assert proc.returncode == 0, (name, proc.stderr)
        assert "Usage:" in proc.stdout


def test_inventory_check_exit_codes(tmp_path: Path) -> None:
    """check exits 0 on a valid file and 2 with one red line on an invalid one."""
    ok = ftctl("inventory", "check", str(LOCAL))
    assert ok.returncode == 0, ok.stderr
    assert "3 workers" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: x\nworkers:\n  - name: w1\n    url: ftp://x\n    model: m\n")
    proc = ftctl("inventory", "check", str(bad))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"error: {bad}:4: workers[0].url: not a valid http(s) URL: 'ftp://x'\n"


def test_debug_shows_traceback(tmp_path: Path) -> None:
    """--debug adds the traceback to the one-line error."""
    proc = ftctl("--debug", "inventory", "check", str(tmp_path / "absent.yaml"))
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
    assert proc.stderr.rstrip().endswith("no such file")


def test_inventory_default_path_and_env(tmp_path: Path) -> None:
    """Without -i the inventory comes from $FTCTL_INVENTORY, then ./ftctl.yaml."""
    (tmp_path / "ftctl.yaml").write_text(LOCAL.read_text())
    proc = ftctl("inventory", "check", cwd=tmp_path, env={"FTCTL_INVENTORY": ""})
    assert proc.returncode == 0, proc.stderr
    proc = ftctl("inventory", "check", cwd=tmp_path, env={"FTCTL_INVENTORY": str(tmp_path / "no.yaml")})
    assert proc.returncode == 2
    assert "no.yaml: no such file" in proc.stderr


def test_json_before_or_after_the_subcommand() -> None:
    """--json works as a root option and as a subcommand option; stdout is one document."""
    for args in (("--json", "-i", str(LOCAL), "inventory", "show"), ("-i", str(LOCAL), "inventory", "show", "--json")):
        proc = ftctl(*args)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["cluster"] == "local"
        assert [w["name"] for w in doc["workers"]] == ["w1", "w2", "w3"]
        assert doc["workers"][0]["launch"]["sim"]["model_config"] == "ftctl-sim-tiny"


def test_schema_is_json_schema() -> None:
    """schema prints a JSON Schema that forbids unknown keys."""
    proc = ftctl("inventory", "schema")
    schema = json.loads(proc.stdout)
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["cluster"]  # workers, or discovery: either will do
    assert {"workers", "discovery"} <= set(schema["properties"])


def test_usage_error_exit_2() -> None:
    """An unknown option or command exits 2."""
    assert ftctl("inventory", "check", "--nope").returncode == 2
    assert ftctl("no-such-command").returncode == 2


@pytest.mark.parametrize(("args", "line"), [
    (["canry"], "error: no such command 'canry' in ftctl (did you mean 'canary'?)"),
    (["canry", "--worker", "w3"],
     "error: no such command 'canry' in ftctl (did you mean 'canary'?)"),
    (["lo"], "error: no such command 'lo' in ftctl (did you mean 'lock' or 'load'?)"),
    (["lock", "acqire"], "error: no such command 'acqire' in ftctl lock (did you mean "
                         "'acquire'?)"),
    (["zzzz"], "error: no such command 'zzzz' in ftctl; ftctl --help lists them"),
], ids=["canry", "canry-with-options", "two-near", "subgroup", "none-near"])
def test_an_unknown_command_names_the_nearest_in_one_line(args: list[str], line: str) -> None:
    """A mistyped command: one line on stderr with the nearest names (difflib), exit 2,
    and no command group imported to find them."""
    proc = ftctl(*args)
    assert proc.returncode == 2
    assert proc.stderr == line + "\n"
    assert proc.stdout == ""
    if args[0] != "lock":
        assert not imported_modules(*args) & {"torch", "httpx", "prometheus_client"}


def test_man_pages_are_current() -> None:
    """man/ matches what `make man` generates from the CLI now."""
    from dynamo_ftctl.cli.manpage import render_pages

    pages = render_pages()
    on_disk = {p.name: p.read_text() for p in (ROOT / "man").glob("ftctl*.1")}
    assert set(on_disk) == set(pages), "run `make man`"
    for name, text in pages.items():
        assert on_disk[name] == text, f"man/{name} is stale: run `make man`"


@pytest.mark.skipif(not Path("/usr/bin/man").exists(), reason="man-db not installed (make test installs it)")
def test_man_page_renders() -> None:
    """`man -l man/ftctl.1` renders without warnings."""
    proc = subprocess.run(
        ["man", "-l", "--warnings", str(ROOT / "man" / "ftctl.1")], capture_output=True, text=True,
        timeout=60, check=False, env={**os.environ, "MANPAGER": "cat", "MANWIDTH": "80"},
    )
    assert proc.returncode == 0
    assert "EXIT STATUS" in proc.stdout
    assert proc.stderr == ""


def test_show_off_a_terminal_prints_whole_values() -> None:
    """`inventory show` into a pipe prints aligned plain columns with uncut URLs and faults."""
    proc = ftctl("-i", str(LOCAL), "inventory", "show")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# cluster local (")
    assert lines[1].split() == ["worker", "url", "model", "node", "gpus", "group", "faults",
                                "notes"]
    assert "http://127.0.0.1:8101" in lines[2]
    assert "xid94" in lines[2]


PROBE_REFUSED = ("canary", "--url", "http://127.0.0.1:9", "--set",
                 str(ROOT / "canaries" / "ftctl-sim-tiny.yaml"), "--no-state")


def ftctl_to(stdout: Any, argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """`ftctl argv` with its stdout on `stdout` (a file or descriptor); stderr captured."""
    return subprocess.run([sys.executable, "-m", "dynamo_ftctl", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False,
                          cwd=ROOT, env={**os.environ, "FTCTL_INVENTORY": ""})


@pytest.mark.parametrize("argv", [
    ("--json", "inventory", "check", str(LOCAL)),  # the full CLI
    PROBE_REFUSED,                                  # the lean one-shot probe
])
def test_a_refused_write_is_one_line_and_exit_1(argv: tuple[str, ...]) -> None:
    """`> /dev/full` (a full disk): one error line, no traceback, nothing more at exit."""
    with open("/dev/full", "w") as full:  # noqa: PTH123 (a device, not a path to build)
        proc = ftctl_to(full, argv)
    assert proc.returncode == 1
    assert proc.stderr == "error: cannot write output: No space left on device\n"


@pytest.mark.parametrize("argv", [
    ("--json", "inventory", "check", str(LOCAL)),
    PROBE_REFUSED,
])
def test_a_reader_that_left_ends_it_silently(argv: tuple[str, ...]) -> None:
    """`ftctl ... | head -0`: the pipe is closed before the answer. Exit 1 (click's choice
    for the full CLI, which the fast path follows) and not a word on stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = ftctl_to(write, argv)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (1, "")
