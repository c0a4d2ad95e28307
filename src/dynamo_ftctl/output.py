"""One place that turns results into output: rich for people, JSON for machines.

Library calls return frozen result objects; the CLI hands them to `emit`.
With `--json`, stdout carries exactly one JSON document (or JSON lines for
streams, via `emit_line`) and nothing else; logs and errors go to stderr.
A result renders for people through `__rich__` when it has one, else as a
key/value table of its JSON form. Off a terminal, tables have no box and no
width limit (nothing is cut: a URL stays whole for grep and copy); on one,
a cell too wide folds onto the next line, never into an ellipsis. No line of
a table ends in spaces, on a terminal or off (rich pads every cell to its
column's width, the last column's too).
Long work shows `progress` on stderr, on a terminal only.

Every renderer here masks secrets in URLs (`redact`): `user:password@` and
token query parameters print as `***`, in tables, text, JSON, errors and
warnings alike. `to_jsonable` keeps them: files that are read back (revert
records, drill inventories) need the real URL.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.redact import redact_text

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.progress import Progress, TaskID
    from rich.segment import Segment
    from rich.table import Table

__all__ = [
    "check_output_dir",
    "check_output_path",
    "emit",
    "emit_line",
    "error",
    "kv_table",
    "make_output_dir",
    "progress",
    "redact_doc",
    "stderr_console",
    "stdout_console",
    "table",
    "to_jsonable",
    "warn",
    "write_atomic",
]


def to_jsonable(value: Any) -> Any:
    """Convert results (dataclasses, msgspec structs, enums, paths) to JSON."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        # JSON has no NaN/Infinity; null is the honest "no value".
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "to_json"):
        return to_jsonable(value.to_json())
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        import dataclasses  # not at the top: the one-shot probe renders no dataclass

        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    struct_fields = getattr(type(value), "__struct_fields__", None)  # a msgspec.Struct
    if struct_fields is not None:
        # The file's key names (`model_config`, not the attribute `model_config_name`).
        keys = type(value).__struct_encode_fields__
        return {key: to_jsonable(getattr(value, name))
                for key, name in zip(keys, struct_fields, strict=True)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes | bytearray):
        return value.hex()
    if isinstance(value, Iterable):
        return [to_jsonable(v) for v in value]
    return str(value)


# Off a terminal a table is as wide as its widest row: no width to fit, nothing cut.
_UNBOUNDED_WIDTH = 100_000


def _console(stream: Any) -> Console:
    from rich.console import Console

    # Off a terminal (logs, pipes, CI) lines keep their length: rich's 80-column
    # default would cut "tokens lost 0, duplicated 0" in two and a URL in a table
    # to "http://127.0.0.1:181…".
    on_terminal = bool(getattr(stream, "isatty", lambda: False)())
    return Console(file=stream, highlight=False, soft_wrap=not on_terminal,
                   width=None if on_terminal else _UNBOUNDED_WIDTH)


def stdout_console() -> Console:
    """A rich console on stdout (for human output only)."""
    return _console(sys.stdout)


def stderr_console() -> Console:
    """A rich console on stderr (logs, progress, errors)."""
    return _console(sys.stderr)


def redact_doc(doc: Any) -> Any:
    """A JSON-shaped `doc` with secrets in URLs masked in every string (keys too)."""
    if isinstance(doc, str):
        return redact_text(doc)
    if isinstance(doc, Mapping):
        return {redact_text(str(k)): redact_doc(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [redact_doc(v) for v in doc]
    return doc


def emit(result: Any, *, json_mode: bool) -> None:
    """Print one result: a JSON document with `json_mode`, else a rich rendering."""
    if json_mode:
        doc = redact_doc(to_jsonable(result))
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")
        sys.stdout.flush()
        return
    if hasattr(result, "plain_text") and not sys.stdout.isatty():
        # Probes, cron and pipes get plain aligned text, and skip rich's ~30 ms import.
        sys.stdout.write(redact_text(result.plain_text()))
        sys.stdout.flush()
        return
    console = stdout_console()
    if isinstance(result, str):
        console.print(redact_text(result))
        return
    if hasattr(result, "__rich__"):
        console.print(result)  # its tables come from `table` (masked cells)
        return
    doc = to_jsonable(result)
    if isinstance(doc, Mapping):
        console.print(kv_table(None, doc))
    else:
        console.print(json.dumps(doc, indent=2))


def plain_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns aligned with spaces, a header line first; every line ends in a newline."""
    cells = [[str(h) for h in headers], *([_cell(v) for v in row] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    return "".join(
        "  ".join(value.ljust(width) for value, width in zip(line, widths, strict=True)).rstrip()
        + "\n"
        for line in cells
    )


def emit_line(record: Any) -> None:
    """Print one JSON line (for streams of events) and flush it at once."""
    sys.stdout.write(json.dumps(redact_doc(to_jsonable(record)), separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping | list | tuple):
        return redact_text(json.dumps(to_jsonable(value)))
    if value is None:
        return "-"
    return redact_text(str(value))


def _default_box() -> Any:
    from rich import box

    return box.HEAVY_HEAD  # rich's own default for Table


def _rstrip_line(line: list[Segment]) -> list[Segment]:
    """One rendered line without the spaces it ends in (control segments are kept)."""
    from rich.segment import Segment

    end = len(line)
    while end and not line[end - 1].control and not line[end - 1].text.rstrip(" "):
        end -= 1
    kept = line[:end]
    if kept and not kept[-1].control:
        last = kept[-1]
        kept[-1] = Segment(last.text.rstrip(" "), last.style, last.control)
    return kept


@functools.cache
def _table_class() -> type[Table]:
    """rich's Table, with the trailing spaces of every line it renders cut (its title and
    caption too, which it centres): the one table class of every renderer here."""
    from rich.segment import Segment
    from rich.table import Table

    class TrimmedTable(Table):
        def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
            rendered = super().__rich_console__(console, options)
            segments = (s for s in rendered if isinstance(s, Segment))  # a Table yields only these
            for line in Segment.split_lines(segments):
                yield from _rstrip_line(line)
                yield Segment.line()

    return TrimmedTable


def kv_table(title: str | None, data: Mapping[str, Any]) -> Table:
    """A two-column key/value table."""
    out = _table_class()(title=title, show_header=False, box=None, pad_edge=False)
    out.add_column(style="bold")
    out.add_column(overflow="fold")
    for key, value in data.items():
        out.add_row(str(key), _cell(value))
    return out


def table(
    title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]],
    *, styles: Mapping[str, str] | None = None,
) -> Table:
    """A table with a header row; `styles` maps column names to rich styles.

    Boxed on a terminal (stdout), plain aligned columns elsewhere: box-drawing
    characters in a pipe only get in grep's and awk's way.
    """
    boxed = sys.stdout.isatty()
    out = _table_class()(title=title, box=_default_box() if boxed else None, show_edge=boxed,
                pad_edge=boxed)
    for name in columns:
        out.add_column(name, style=(styles or {}).get(name), overflow="fold")
    for row in rows:
        out.add_row(*(_cell(v) for v in row))
    return out


class ProgressLine:
    """The progress of one long job: a live line on stderr when it is a terminal, else silent.

    `print` writes a log line: above the live line on a terminal, as a plain line
    on stderr otherwise (unless quiet: `--json` runs say nothing on stderr but errors).
    """

    def __init__(self, bar: Progress | None, task: TaskID | None, *, quiet: bool) -> None:
        self._bar = bar
        self._task = task
        self._quiet = quiet

    def update(self, completed: float, total: float | None = None,
               note: str | None = None) -> None:
        """`completed` of `total` steps done (total None: unknown); `note` replaces the text."""
        if self._bar is None or self._task is None:
            return
        fields: dict[str, Any] = {"completed": completed}
        if total is not None:
            fields["total"] = total
        if note is not None:
            fields["description"] = one_line(redact_text(note))
        self._bar.update(self._task, **fields)

    def note(self, text: str) -> None:
        """Replace the live line's text (nothing off a terminal)."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=one_line(redact_text(text)))

    def print(self, line: str) -> None:
        """One log line on stderr, above the live line where there is one."""
        if self._quiet:
            return
        line = one_line(redact_text(line))
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


@contextlib.contextmanager
def progress(description: str, *, total: float | None = None, counted: bool = True,
             quiet: bool = False) -> Iterator[ProgressLine]:
    """Show `description`, a bar with done/total (a pulse while `total` is None; neither
    for work that is not `counted`) and the elapsed time on stderr while the block runs,
    on a terminal only: piped, or `quiet` (`--json`), nothing is drawn. The line is
    cleared at the end; the result prints after it."""
    if quiet or not sys.stderr.isatty():
        yield ProgressLine(None, None, quiet=quiet)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    steps = (BarColumn(), MofNCompleteColumn()) if counted else ()
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), *steps,
                   TimeElapsedColumn(), console=stderr_console(), transient=True)
    with bar:
        task = bar.add_task(one_line(redact_text(description)), total=total)
        yield ProgressLine(bar, task, quiet=quiet)


def one_line(message: str) -> str:
    """`message` with control characters escaped (a key named "\\r" must not break the line)."""
    if message.isprintable():
        return message
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def error(message: str) -> None:
    """One red line on stderr (the CLI's only way to report a failure)."""
    message = one_line(redact_text(message))
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        sys.stderr.write(f"\x1b[31merror:\x1b[0m {message}\n")
    else:
        sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def warn(message: str) -> None:
    """One warning line on stderr."""
    sys.stderr.write(f"warning: {one_line(redact_text(message))}\n")
    sys.stderr.flush()


# Output paths are safefiles' (every file ftctl writes is opened there); these names stay
# here for the callers that import them with the rest of the output seam.
from dynamo_ftctl.safefiles import (  # noqa: E402 - re-exported, after the renderers
    check_output_dir,
    check_output_path,
    make_output_dir,
    write_atomic,
)
