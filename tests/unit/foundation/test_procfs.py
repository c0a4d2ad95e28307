"""`procfs`: state, start time and arguments of a process, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_ftctl import procfs


def test_this_process_is_running_with_a_start_time_and_its_arguments() -> None:
    """Our own pid reads as a live process whose start time does not change."""
    state = procfs.stat(os.getpid())
    assert state is not None
    assert state[0] in ("R", "S")
    assert state[1].isdigit()
    assert procfs.stat(os.getpid()) == state
    args = procfs.cmdline(os.getpid())
    assert args is not None
    assert args[0]


def test_a_command_name_with_spaces_and_parentheses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fields are read after the command name's last ")", whatever the name holds."""
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (a) b (c) Z 1 7 7" + " 0" * 15 + " 4242 0 0\n")
    monkeypatch.setattr(procfs, "PROC", tmp_path)
    assert procfs.stat(7) == ("Z", "4242")


def test_a_pid_that_does_not_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid without a /proc entry (gone, or never there) reads as None."""
    monkeypatch.setattr(procfs, "PROC", tmp_path)
    assert procfs.stat(99) is None
    assert procfs.cmdline(99) is None
