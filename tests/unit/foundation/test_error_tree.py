"""The exception classes of ftctl against the tree drawn in errors.py's docstring.

Every `FtctlError` subclass is drawn there, under its real parent, with its real exit
code and the module that defines it; no two exception classes share a name; and each
package keeps its exceptions in one module. The source is read with `ast`, so no
package is imported but the few modules the tree names.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import dynamo_ftctl
from dynamo_ftctl import errors
from dynamo_ftctl.errors import FtctlError

SRC = Path(dynamo_ftctl.__file__).parent

# Packages whose exceptions are still spread over several modules: migrate/ is being
# moved into proxy/, which gathers them. Remove an entry once it holds.
SPREAD_OUT: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ClassDef:
    """One class statement of the source."""

    name: str
    module: str  # below dynamo_ftctl, dotted: "engine.errors", "http1"
    bases: tuple[str, ...]  # each base's last name: "errors.InvalidInput" -> "InvalidInput"


@dataclass(frozen=True)
class Drawn:
    """One line of the tree: a class, its exit code, the module named (errors if none)."""

    name: str
    code: int
    module: str
    parent: str | None


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def _class_defs() -> list[ClassDef]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found.extend(
            ClassDef(node.name, _module_of(path),
                     tuple(ast.unparse(b).rpartition(".")[2] for b in node.bases))
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef))
    return found


CLASSES = _class_defs()
_BY_NAME: dict[str, list[ClassDef]] = defaultdict(list)
for _c in CLASSES:
    _BY_NAME[_c.name].append(_c)


def _derives(name: str, root: type[BaseException], seen: frozenset[str] = frozenset()) -> bool:
    """Whether the class `name` (of the source, or a builtin) is a subclass of `root`."""
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type):
        return issubclass(builtin, root)
    if name == root.__name__:
        return True
    if name in seen:
        return False
    return any(_derives(base, root, seen | {name})
               for c in _BY_NAME.get(name, ()) for base in c.bases)


def _exceptions() -> list[ClassDef]:
    return [c for c in CLASSES if any(_derives(b, BaseException) for b in c.bases)]


_LINE = re.compile(r"^(?P<lead>[ │├└─]*)(?P<name>[A-Z]\w+) \((?P<code>\d+)\)\s*(?P<rest>.*)$")


def _drawn() -> list[Drawn]:
    """The tree in errors.py's docstring, line by line."""
    modules = {_module_of(p) for p in SRC.rglob("*.py")}
    assert errors.__doc__ is not None
    drawn: list[Drawn] = []
    parents: list[str] = []  # the chain above the current line, by depth
    root_col: int | None = None
    for line in errors.__doc__.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        col = len(match["lead"])
        root_col = col if root_col is None else root_col
        depth = (col - root_col) // 4
        del parents[depth:]
        head = match["rest"].partition(": ")[0]
        module = head if ": " in match["rest"] and head in modules else "errors"
        drawn.append(Drawn(match["name"], int(match["code"]), module,
                           parents[-1] if parents else None))
        parents.append(match["name"])
    return drawn


def test_the_tree_is_read() -> None:
    """The parser finds the root, a nested class and a class of another module."""
    by_name = {d.name: d for d in _drawn()}
    assert by_name["FtctlError"] == Drawn("FtctlError", 1, "errors", None)
    assert by_name["InventoryError"] == Drawn("InventoryError", 2, "errors", "InvalidInput")
    assert by_name["ParamError"] == Drawn("ParamError", 2, "engine.errors", "InvalidInput")


def test_no_two_exception_classes_share_a_name() -> None:
    """Each exception class name is defined once in the whole package."""
    where: dict[str, list[str]] = defaultdict(list)
    for c in _exceptions():
        where[c.name].append(c.module)
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


def test_every_ftctl_error_is_drawn() -> None:
    """The tree names exactly the `FtctlError` subclasses the source defines."""
    defined = {c.name for c in CLASSES if _derives(c.name, FtctlError)}
    assert defined == {d.name for d in _drawn()}


def test_each_drawn_class_has_its_module_parent_and_exit_code() -> None:
    """Each line of the tree is true of the class it names, imported from its module."""
    drawn = _drawn()
    classes = {d.name: getattr(importlib.import_module(f"dynamo_ftctl.{d.module}"), d.name)
               for d in drawn}
    for d in drawn:
        cls = classes[d.name]
        assert int(cls.exit_code) == d.code, d
        if d.parent is not None:
            assert cls.__bases__ == (classes[d.parent],), d


def test_each_package_keeps_its_exceptions_in_one_module() -> None:
    """Outside errors.py, a package's exception classes are all in one of its modules."""
    modules: dict[str, set[str]] = defaultdict(set)
    for c in _exceptions():
        package = c.module.partition(".")[0]
        if c.module != "errors" and package not in SPREAD_OUT:
            modules[package].add(c.module)
    assert {p: sorted(m) for p, m in modules.items() if len(m) > 1} == {}
