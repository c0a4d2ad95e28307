"""One place that turns results into output: rich for people, JSON for machines.

Library calls return frozen result objects; the CLI hands them to `emit`.
With `--json`, stdout carries exactly one JSON document (or JSON lines for
streams, via `emit_line`) and nothing else; logs and errors go to stderr.
A result renders for people through `__rich__` when it has one, else as a
key/value table of its JSON form.

Every renderer here masks secrets in URLs (`redact`): `user:password@` and
token query parameters print as `***`, in tables, text, JSON, errors and
warnings alike. `to_jsonable` keeps them: files that are read back (revert
records, drill inventories) need the real URL.
"""

from __future__ import annotations

import enum
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.redact import redact_text

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "emit",
    "emit_line",
    "error",
    "kv_table",
    "redact_doc",
    "stderr_console",
    "stdout_console",
    "table",
    "to_jsonable",
    "warn",
    "write_atomic",
]


def to_jsonable(value: Any) -> Any:
    """Convert results (dataclasses, msgspec structs, pydantic models, enums, paths) to JSON."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        # JSON has no NaN/Infinity; null is the honest "no value".
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "model_dump"):
        return to_jsonable(value.model_dump(mode="json", by_alias=True))
    if hasattr(value, "to_json"):
        return to_jsonable(value.to_json())
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        import dataclasses  # not at the top: the one-shot probe renders no dataclass

        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    struct_fields = getattr(type(value), "__struct_fields__", None)  # a msgspec.Struct
    if struct_fields is not None:
        return {name: to_jsonable(getattr(value, name)) for name in struct_fields}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes | bytearray):
        return value.hex()
    if isinstance(value, Iterable):
        return [to_jsonable(v) for v in value]
    return str(value)


def _console(stream: Any) -> Console:
    from rich.console import Console

    # Off a terminal (logs, pipes, CI) text lines keep their length: rich's 80-column
    # default would cut "tokens lost 0, duplicated 0" in two. Tables still fit the width.
    on_terminal = bool(getattr(stream, "isatty", lambda: False)())
    return Console(file=stream, highlight=False, soft_wrap=not on_terminal)


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


def kv_table(title: str | None, data: Mapping[str, Any]) -> Table:
    """A two-column key/value table."""
    from rich.table import Table

    out = Table(title=title, show_header=False, box=None, pad_edge=False)
    out.add_column(style="bold")
    out.add_column()
    for key, value in data.items():
        out.add_row(str(key), _cell(value))
    return out


def table(
    title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]],
    *, styles: Mapping[str, str] | None = None,
) -> Table:
    """A table with a header row; `styles` maps column names to rich styles."""
    from rich.table import Table

    out = Table(title=title)
    for name in columns:
        out.add_column(name, style=(styles or {}).get(name))
    for row in rows:
        out.add_row(*(_cell(v) for v in row))
    return out


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


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o644) -> None:
    """Write `data` to `path` through a temporary file and a rename, never half-written."""
    payload = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
