"""The public API of ftctl: every module declares `__all__`, and the packages' is pinned.

Every module under `dynamo_ftctl` has a literal `__all__` naming only what it defines or
imports (or what its module `__getattr__` serves). What each package exports
(`__init__`'s `__all__`) is compared with public_api.json, so that a change to it is a
deliberate one: after one, rewrite the file with
`PYTHONPATH=src python tests/unit/foundation/test_public_api.py` and commit it.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest

import dynamo_ftctl

SRC = Path(dynamo_ftctl.__file__).parent
SNAPSHOT = Path(__file__).with_name("public_api.json")

def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}
PACKAGES = sorted(name for name, p in MODULES.items() if p.name == "__init__.py")


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _bound(body: list[ast.stmt]) -> set[str]:
    """Names the statements bind at run time (an `if TYPE_CHECKING:` block binds none)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            names |= _bound(node.body) | _bound(node.orelse)
        elif isinstance(node, ast.Try):
            names |= _bound(node.body) | _bound(node.orelse) | _bound(node.finalbody)
            for handler in node.handlers:
                names |= _bound(handler.body)
    return names


def _served_lazily(tree: ast.Module) -> set[str]:
    """The strings a module-level `__getattr__` mentions, and the keys of the module's
    dicts it reads (`_LATE = {"Client": "client", ...}`): the names it may serve."""
    hooks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    used = {name.id for hook in hooks for name in ast.walk(hook) if isinstance(name, ast.Name)}
    served = {const.value for hook in hooks for const in ast.walk(hook)
              if isinstance(const, ast.Constant) and isinstance(const.value, str)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id in used for t in node.targets):
            served |= {k.value for k in node.value.keys
                       if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return served


def _declared(tree: ast.Module) -> list[str] | None:
    """The module's `__all__`, which must be a literal list or tuple of strings."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert isinstance(node, ast.Assign | ast.AnnAssign)
            assert node.value is not None
            value = ast.literal_eval(node.value)
            assert isinstance(value, list | tuple), ast.unparse(node)
            assert all(isinstance(v, str) for v in value), ast.unparse(node)
            return list(value)
    return None


def _tree(module: str) -> ast.Module:
    path = MODULES[module]
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def package_api() -> dict[str, list[str]]:
    """Each package's `__all__`, sorted: what public_api.json holds."""
    return {p: sorted(_declared(_tree(p)) or []) for p in PACKAGES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_declares_what_it_has(module: str) -> None:
    """A module's `__all__` exists, has no repeats, and names only what the module binds."""
    tree = _tree(module)
    declared = _declared(tree)
    assert declared is not None, f"{module} has no __all__"
    assert len(set(declared)) == len(declared), f"{module}: a name repeats in __all__"
    unknown = set(declared) - _bound(tree.body) - _served_lazily(tree)
    assert unknown == set(), f"{module}: __all__ names what it does not define or import"


def test_checks_see_a_bad_all() -> None:
    """The checks catch a name neither bound nor served, and accept lazy and real names."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from x import Hidden\n"
        "from y import Real\n"
        "def __getattr__(name):\n    if name == 'Lazy':\n        return 1\n"
        "__all__ = ['Real', 'Lazy', 'Hidden']\n")
    assert _declared(tree) == ["Real", "Lazy", "Hidden"]
    assert {"Real", "Lazy", "Hidden"} - _bound(tree.body) - _served_lazily(tree) == {"Hidden"}


def test_package_api_is_the_snapshot() -> None:
    """What each package exports is public_api.json, so a change to it is deliberate."""
    assert package_api() == json.loads(SNAPSHOT.read_text(encoding="utf-8"))


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "dynamo_ftctl.vllm_connector"])
def test_package_exports_resolve(package: str) -> None:
    """Each name a package exports is there once it is imported (vllm_connector's one
    name needs vLLM: its lazy `__getattr__` is checked above, statically)."""
    module = importlib.import_module(package)
    missing = [name for name in package_api()[package] if not hasattr(module, name)]
    assert missing == []


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(package_api(), indent=1) + "\n", encoding="utf-8")
    sys.stdout.write(f"wrote {SNAPSHOT}\n")
