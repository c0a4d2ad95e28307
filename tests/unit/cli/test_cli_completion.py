"""`ftctl completion` and the answers behind it, through click's env-var protocol in a
real process (`_FTCTL_COMPLETE=bash_complete`, `COMP_WORDS`, `COMP_CWORD`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LOCAL = ROOT / "examples" / "local.yaml"
HEAVY = ("torch", "httpx", "aiohttp", "uvicorn", "starlette", "matplotlib", "pynvml")
INVENTORY = """\
cluster: t
workers:
  - {name: alpha, url: "http://127.0.0.1:9", model: m, faults: [kill, slow]}
  - {name: beta, url: "http://127.0.0.1:9", model: m, faults: [xid48]}
  - {name: vault, url: "http://127.0.0.1:9", model: m, faults: [term], protected: true}
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "NO_COLOR": "1", "FTCTL_INVENTORY": ""}
    env.update(extra)
    return env


def complete(line: str, *, cwd: Path, importtime: bool = False,
             **env: str) -> subprocess.CompletedProcess[str]:
    """What bash's TAB at the end of `line` asks ftctl for (words split as bash does)."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "dynamo_ftctl"], capture_output=True, text=True,
        timeout=120, check=False, cwd=cwd,
        env=_env(COMP_WORDS=" ".join(words) + (" " if line.endswith(" ") else ""),
                 COMP_CWORD=str(cword), _FTCTL_COMPLETE="bash_complete", **env),
    )


def values(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The values of a bash_complete answer (`type,value` lines)."""
    assert proc.returncode == 0, proc.stderr
    return [line.split(",", 1)[1] for line in proc.stdout.splitlines() if line]


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    return path


@pytest.mark.parametrize("line", [
    "ftctl -i {inv} canary --worker ",
    "ftctl canary -i {inv} -w ",
    "ftctl canary record --inventory {inv} --worker ",
    "ftctl -i {inv} migrate request --from ",
    "ftctl inject kill -i {inv} --worker ",
])
def test_worker_names_from_the_inventory_on_the_line(
    line: str, inventory: Path, tmp_path: Path,
) -> None:
    """--worker/-w (and --from) complete the inventory's worker names, -i before or after."""
    assert values(complete(line.format(inv=inventory), cwd=tmp_path)) == [
        "alpha", "beta", "vault"]


def test_worker_names_filter_by_the_typed_prefix(inventory: Path, tmp_path: Path) -> None:
    """A partial word keeps the names it starts."""
    assert values(complete(f"ftctl -i {inventory} canary -w al", cwd=tmp_path)) == ["alpha"]


def test_load_workers_completes_the_last_name_of_the_list(
    inventory: Path, tmp_path: Path,
) -> None:
    """`load --workers alpha,` offers the other workers after the comma."""
    got = values(complete(f"ftctl -i {inventory} load --workers alpha,", cwd=tmp_path))
    assert got == ["alpha,beta", "alpha,vault"]


def test_inventory_from_the_environment_then_the_current_directory(tmp_path: Path) -> None:
    """Without -i: $FTCTL_INVENTORY, else ./ftctl.yaml (examples/local.yaml's w1..w3)."""
    assert values(complete("ftctl canary -w ", cwd=tmp_path, FTCTL_INVENTORY=str(LOCAL))) == [
        "w1", "w2", "w3"]
    (tmp_path / "ftctl.yaml").write_text(LOCAL.read_text().replace("../canaries", "c"))
    assert values(complete("ftctl canary -w ", cwd=tmp_path)) == ["w1", "w2", "w3"]


def test_fault_names_after_inject_are_the_inventory_allowlists(
    inventory: Path, tmp_path: Path,
) -> None:
    """`ftctl inject <TAB>`: faults some unprotected worker allows, then the subcommands."""
    got = values(complete(f"ftctl -i {inventory} inject ", cwd=tmp_path))
    assert got == ["kill", "slow", "xid48", "revert", "netproxy"]
    got = values(complete(f"ftctl inject -i {inventory} s", cwd=tmp_path))
    assert got == ["slow"]


@pytest.mark.parametrize("content", [None, "workers: [unclosed\n", "cluster: 1\n"])
def test_an_unreadable_inventory_completes_nothing_silently(
    content: str | None, tmp_path: Path,
) -> None:
    """Missing, broken or invalid inventory: no names, no error text, exit 0."""
    if content is not None:
        (tmp_path / "ftctl.yaml").write_text(content)
    proc = complete("ftctl canary --worker ", cwd=tmp_path)
    assert values(proc) == []
    assert proc.stderr == ""


def test_commands_and_options_complete(tmp_path: Path) -> None:
    """Subcommand names and a command's visible options (not the inherited hidden ones)."""
    assert values(complete("ftctl lo", cwd=tmp_path)) == ["load", "lock"]
    options = values(complete("ftctl lock owner --", cwd=tmp_path))
    assert "--path" in options
    assert "--debug" not in options


@pytest.mark.parametrize("line", ["ftctl -i exa", "ftctl canary -i exa",
                                  "ftctl lock owner --path exa", "ftctl inventory check exa"])
def test_path_parameters_ask_the_shell_for_file_names(line: str, tmp_path: Path) -> None:
    """-i (before or after), --path, FILE: the answer is `file`, so the shell lists files."""
    proc = complete(line, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["file,exa"]


def test_completing_stays_light(inventory: Path, tmp_path: Path) -> None:
    """Completing inject's workers imports none of the heavy libraries."""
    proc = complete(f"ftctl -i {inventory} inject kill --worker ", cwd=tmp_path,
                    importtime=True)
    assert proc.returncode == 0
    assert "alpha" in proc.stdout
    loaded = {line.rsplit("|", 1)[1].strip().split(".")[0]
              for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def _script(shell: str, tmp_path: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "completion", shell],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path, env=_env())
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_script_is_valid_bash_and_completes_worker_names(
    inventory: Path, tmp_path: Path,
) -> None:
    """`bash -n` accepts the script; sourced in bash, its function fills COMPREPLY."""
    script = tmp_path / "ftctl.bash"
    script.write_text(_script("bash", tmp_path))
    assert "_ftctl_completion()" in script.read_text()
    assert "complete -o nosort -F _ftctl_completion ftctl" in script.read_text()
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                           timeout=60, check=False)
    assert check.returncode == 0, check.stderr
    # An `ftctl` on PATH, as the script calls it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ftctl").write_text(f'#!/bin/sh\nexec {sys.executable} -m dynamo_ftctl "$@"\n')
    (bin_dir / "ftctl").chmod(0o755)
    driver = (f"source {script}\n"
              f"COMP_WORDS=(ftctl -i {inventory} canary --worker ''); COMP_CWORD=5\n"
              "_ftctl_completion ftctl\n"
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    proc = subprocess.run(["bash", "--norc", "-c", driver], capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path,
                          env=_env(PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["alpha", "beta", "vault"]


@pytest.mark.parametrize(("shell", "marker"), [("zsh", "#compdef ftctl"),
                                               ("fish", "complete --no-files --command ftctl")])
def test_zsh_and_fish_scripts(shell: str, marker: str, tmp_path: Path) -> None:
    """zsh and fish get their script, calling ftctl with their own instruction."""
    text = _script(shell, tmp_path)
    assert marker in text
    assert f"_FTCTL_COMPLETE={shell}_complete" in text


def test_an_unknown_shell_is_a_usage_error(tmp_path: Path) -> None:
    """`ftctl completion tcsh` exits 2; so does a malformed completion instruction."""
    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "completion", "tcsh"],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path, env=_env())
    assert proc.returncode == 2
    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl"], capture_output=True,
                          text=True, timeout=120, check=False, cwd=tmp_path,
                          env=_env(_FTCTL_COMPLETE="complete_bash"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: _FTCTL_COMPLETE=complete_bash")
