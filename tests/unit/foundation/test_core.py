"""errors, clock and output: exit codes, fake time, JSON rendering, atomic writes."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path

import pytest

from dynamo_ftctl.clock import SYSTEM_CLOCK, FakeClock
from dynamo_ftctl.errors import (
    CheckFailed,
    ExitCode,
    FtctlError,
    Interrupted,
    InvalidInput,
    InventoryError,
    LockTimeout,
    Unreachable,
)
from dynamo_ftctl.output import emit, plain_table, to_jsonable, write_atomic


def test_exit_codes_match_the_design() -> None:
    """Each error class carries the exit code docs/design.md assigns it."""
    assert [c.exit_code for c in (FtctlError, CheckFailed, InvalidInput, Unreachable, LockTimeout, Interrupted)] == [1, 1, 2, 3, 4, 130]
    assert InventoryError("x").exit_code == ExitCode.USAGE


def test_inventory_error_message_shape() -> None:
    """InventoryError renders file:line: key: reason, omitting absent parts."""
    assert str(InventoryError("bad", path="a.yaml", line=3, key="workers[0].url")) == "a.yaml:3: workers[0].url: bad"
    assert str(InventoryError("bad", path="a.yaml")) == "a.yaml: bad"
    assert str(InventoryError("bad")) == "bad"


def test_fake_clock_advances_only_when_told() -> None:
    """FakeClock moves on advance() and sleep(), never backwards, and records sleeps."""
    clock = FakeClock(start=10.0)
    assert clock.now() == 10.0
    clock.sleep(2.5)
    clock.advance(0.5)
    assert clock.now() == 13.0
    assert clock.sleeps == [2.5]
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)


async def _asleep(clock: FakeClock) -> float:
    await clock.asleep(60)
    return clock.now()


def test_fake_clock_async_sleep_is_instant() -> None:
    """asleep(60) on a FakeClock returns at once with time moved by 60 s."""
    import asyncio

    clock = FakeClock(start=0.0)
    assert asyncio.run(_asleep(clock)) == 60.0


def test_system_clock_is_monotonic() -> None:
    """The real clock never goes backwards."""
    first = SYSTEM_CLOCK.now()
    assert SYSTEM_CLOCK.now() >= first


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str
    path: Path
    color: Color
    ratio: float
    items: tuple[int, ...]


def test_to_jsonable_handles_results() -> None:
    """Dataclasses, enums, paths, tuples and non-finite floats become plain JSON."""
    doc = to_jsonable(Sample("a", Path("/x"), Color.RED, math.inf, (1, 2)))
    assert doc == {"name": "a", "path": "/x", "color": "red", "ratio": None, "items": [1, 2]}
    json.dumps(doc)


def test_emit_json_is_one_document(capsys: pytest.CaptureFixture[str]) -> None:
    """emit(json_mode=True) writes exactly one JSON document to stdout."""
    emit({"a": 1, "b": [1.5]}, json_mode=True)
    out = capsys.readouterr()
    assert json.loads(out.out) == {"a": 1, "b": [1.5]}
    assert out.err == ""


def test_emit_human_renders_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    """emit without json renders mappings as a key/value table."""
    emit({"workers": 3}, json_mode=False)
    assert "workers" in capsys.readouterr().out


def test_write_atomic_replaces_whole_file(tmp_path: Path) -> None:
    """write_atomic leaves either the old or the new content, and no temporary file."""
    target = tmp_path / "sub" / "state.json"
    write_atomic(target, "one")
    write_atomic(target, b"two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_write_atomic_failure_keeps_old_content(tmp_path: Path) -> None:
    """A failed write leaves the previous content untouched and cleans up."""
    target = tmp_path / "state.json"
    write_atomic(target, "old")

    with pytest.raises(TypeError):
        write_atomic(target, object())  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


class _Both:
    """A result with a rich rendering and a plain one."""

    def plain_text(self) -> str:
        return "plain rendering\n"

    def __rich__(self) -> str:
        return "rich rendering"


def test_emit_off_a_terminal_prefers_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """Pipes and probes (no terminal) get a result's plain_text, not its rich rendering."""
    emit(_Both(), json_mode=False)
    assert capsys.readouterr().out == "plain rendering\n"


def test_plain_table_aligns_columns() -> None:
    """plain_table pads every column to its widest cell and trims trailing blanks."""
    text = plain_table(["worker", "verdict"], [("w1", "HEALTHY"), ("worker-22", None)])
    assert text.splitlines() == [
        "worker     verdict",
        "w1         HEALTHY",
        "worker-22  -",
    ]


def test_to_jsonable_handles_structs() -> None:
    """msgspec structs (the probe's result types) become plain JSON like dataclasses."""
    import msgspec

    class Point(msgspec.Struct, frozen=True):
        name: str
        where: Path
        ratio: float

    assert to_jsonable(Point("p", Path("/y"), math.nan)) == {"name": "p", "where": "/y",
                                                             "ratio": None}
