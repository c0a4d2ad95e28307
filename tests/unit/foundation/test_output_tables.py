"""Tables as `output` renders them: no line ends in spaces, boxed or plain, at any width."""

from __future__ import annotations

import io
import re
import sys
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from dynamo_ftctl import output

# Escape sequences a terminal console writes around styled text.
ANSI = re.compile(r"\x1b\[[0-9;]*m")

TEXT = st.text(alphabet=st.one_of(st.characters(blacklist_categories=("Cc", "Cs")),
                                  st.sampled_from(" \n")), max_size=24)
CELL = st.one_of(TEXT, st.integers(), st.floats(allow_nan=False), st.none(),
                 st.lists(st.integers(), max_size=3))


@st.composite
def tables(draw: Any) -> tuple[str | None, list[str], list[list[Any]]]:
    """A title (or none), 1-5 column names and 0-6 rows of cells of every kind `_cell` takes."""
    columns = draw(st.lists(TEXT, min_size=1, max_size=5))
    rows = draw(st.lists(st.lists(CELL, min_size=len(columns), max_size=len(columns)),
                         max_size=6))
    return draw(st.none() | TEXT), columns, rows


def _rendered(renderable: Any, *, terminal: bool, width: int) -> str:
    stream = io.StringIO()
    if terminal:
        console = Console(file=stream, force_terminal=True, width=width, highlight=False,
                          color_system="truecolor")
    else:
        console = output._console(stream)  # what `emit` uses off a terminal
    console.print(renderable)
    return ANSI.sub("", stream.getvalue())


def _no_trailing_spaces(text: str) -> None:
    ends = [line for line in text.split("\n") if line.endswith(" ")]
    assert not ends, f"lines ending in spaces: {ends!r}\n{text}"


@settings(max_examples=150, deadline=None)
@given(table=tables(), terminal=st.booleans(), width=st.integers(min_value=10, max_value=200))
def test_no_table_line_ends_in_spaces(table: tuple[str | None, list[str], list[list[Any]]],
                                      terminal: bool, width: int) -> None:
    """`table` (boxed on a terminal, plain off one) and `kv_table` never pad a line's end."""
    title, columns, rows = table
    with mock.patch.object(sys.stdout, "isatty", return_value=terminal):
        rendered = output.table(title, columns, rows)
    _no_trailing_spaces(_rendered(rendered, terminal=terminal, width=width))
    pairs = {str(c): row[0] if row else None for c, row in zip(columns, rows or [[]] * 5,
                                                               strict=False)}
    _no_trailing_spaces(_rendered(output.kv_table(title, pairs), terminal=terminal, width=width))


def test_the_content_of_a_table_is_unchanged_but_for_the_padding() -> None:
    """Trimming keeps every cell and the column alignment: only line ends lose spaces."""
    with mock.patch.object(sys.stdout, "isatty", return_value=False):
        rendered = output.table("t", ["name", "value"], [["a", "1"], ["longer name", "22"]])
    lines = _rendered(rendered, terminal=False, width=80).splitlines()
    assert lines == ["t", "name         value", "a            1",
                     "longer name  22"]
