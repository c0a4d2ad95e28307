"""Find files opened for writing in Python source, by its syntax tree (not by grep).

`raw_writes(source)` lists every call that opens, creates or replaces a file without
going through `dynamo_ftctl.safefiles`: `open`/`Path.open`/`io.open`/`os.fdopen` with a
mode holding w, a, x or +, `write_text`, `write_bytes`, `touch`, `os.open` with a write
flag, `shutil` copies and moves, and `tempfile`'s file makers. A mode or flags that are
not literals count as writes (what cannot be read from the source is not trusted).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

_WRITE_MODE_CHARS = set("wax+")
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
_READ_FLAGS = {"O_RDONLY", "O_DIRECTORY", "O_NOFOLLOW", "O_CLOEXEC", "O_NONBLOCK",
               "O_NOCTTY", "O_PATH", "O_NOATIME"}
_SHUTIL = {"copy", "copy2", "copyfile", "copytree", "move", "copyfileobj"}
_TEMPFILE = {"NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile", "mkstemp"}
_PATH_WRITERS = {"write_text", "write_bytes", "touch"}


@dataclass(frozen=True)
class RawWrite:
    """One call that writes a file outside safefiles: its line and what it is."""

    line: int
    form: str


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _mode_writes(node: ast.expr | None) -> bool:
    """Whether a mode argument may open for writing (no mode: read)."""
    if node is None:
        return False
    strings = [n.value for n in ast.walk(node)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if not strings:
        return True  # a mode from a variable: not provably a read
    return any(_WRITE_MODE_CHARS & set(s) for s in strings)


def _flags_write(node: ast.expr | None) -> bool:
    """Whether os.open flags may include a write flag."""
    if node is None:
        return False
    tests = {id(n) for e in ast.walk(node) if isinstance(e, ast.IfExp)
             for n in ast.walk(e.test)}  # `A if follow else B`: `follow` is no flag
    names = {n.attr if isinstance(n, ast.Attribute) else n.id
             for n in ast.walk(node)
             if isinstance(n, ast.Attribute | ast.Name) and id(n) not in tests}
    names.discard("os")
    if names & _WRITE_FLAGS:
        return True
    return not names <= _READ_FLAGS  # a flag from a variable: not provably a read


def _arg(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[index] if len(call.args) > index else None


def _classify(call: ast.Call) -> str | None:
    func = call.func
    name = _dotted(func)
    if isinstance(func, ast.Name) and func.id == "open":
        return "open" if _mode_writes(_arg(call, 1, "mode")) else None
    if not isinstance(func, ast.Attribute):
        return None
    attr = func.attr
    if name in {"os.open"}:
        return "os.open" if _flags_write(_arg(call, 1, "flags")) else None
    if name == "os.fdopen":
        return "os.fdopen" if _mode_writes(_arg(call, 1, "mode")) else None
    if name in {"io.open", "codecs.open"}:
        return name if _mode_writes(_arg(call, 1, "mode")) else None
    if attr == "open" and _dotted(func.value) not in {"os", "io", "codecs"}:
        # Path.open(mode): the mode is the first argument. `pool.open(key, ...)` is no
        # file: a first argument counts as a mode when it holds a string or is `mode`.
        mode = _arg(call, 0, "mode")
        if isinstance(mode, ast.Name) and "mode" not in mode.id.lower():
            return None
        return ".open" if _mode_writes(mode) else None
    if attr in _PATH_WRITERS:
        return f".{attr}"
    if name.startswith("shutil.") and attr in _SHUTIL:
        return name
    if name.startswith("tempfile.") and attr in _TEMPFILE:
        return name
    return None


def raw_writes(source: str) -> list[RawWrite]:
    """Every call in `source` that writes a file without safefiles, in line order."""
    found: list[RawWrite] = []
    tree = ast.parse(source)
    imported = {alias.asname or alias.name: f"{node.module}.{alias.name}"
                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names if node.module in {"shutil", "tempfile", "os"}}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        form = _classify(node)
        if form is None and isinstance(node.func, ast.Name) and node.func.id in imported:
            full = imported[node.func.id]  # `from shutil import copy` and the like
            module, _, attr = full.partition(".")
            if (module == "shutil" and attr in _SHUTIL) or (
                    module == "tempfile" and attr in _TEMPFILE) or (full == "os.open" and _flags_write(_arg(node, 1, "flags"))) or (full == "os.fdopen" and _mode_writes(_arg(node, 1, "mode"))):
                form = full
        if form is not None:
            found.append(RawWrite(node.lineno, form))
    return sorted(found, key=lambda w: w.line)
