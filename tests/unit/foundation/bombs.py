"""YAML alias bombs by name, for the tests of `documents` and `benchmarks/chaos.py`.

Each is a mapping at the top whose aliases repeat more than `documents` allows: few
nodes and many bytes (one large anchored scalar, repeated flat or through lists of
aliases), or many nodes and few bytes (the classic "billion laughs"). `ALIAS_BOMBS`
gives, for each, a function that writes its text and the words of its one-line error.
"""

from __future__ import annotations

from collections.abc import Callable

EXPANDS = "YAML aliases expand the document past 16 MiB"
REPEATS = "YAML aliases repeat more than 10,000 nodes"


def scalar_bomb(scalar_bytes: int, aliases: int) -> str:
    """One anchored scalar of `scalar_bytes` repeated by `aliases` aliases in a list."""
    return ("big: &big " + "x" * scalar_bytes + "\nx:\n" + "  - *big\n" * aliases)


def nested_scalar_bomb(scalar_bytes: int = 200_000, width: int = 16, levels: int = 3) -> str:
    """An anchored scalar under `levels` anchored lists of `width` aliases each: few
    nodes (9,025 repeated for the defaults), a scalar repeated width**levels times."""
    lines = ["l0: &l0 " + "x" * scalar_bytes]
    for level in range(1, levels + 1):
        lines.append(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]")
    lines.append(f"x: *l{levels}")
    return "\n".join(lines) + "\n"


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    """The classic: each level an anchored list of `width` aliases to the one below."""
    lines = ['l0: &l0 "lol"']
    for level in range(1, levels + 1):
        lines.append(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]")
    lines.append(f"x: *l{levels}")
    return "\n".join(lines) + "\n"


# name: (text, the words its one-line error holds). Issue 30's cases first; its 951 KB
# file is the largest scalar that fits under the 1 MiB limit with 4,000 aliases.
ALIAS_BOMBS: dict[str, tuple[Callable[[], str], str]] = {
    "500KB-x4000": (lambda: scalar_bomb(500_000, 4_000), EXPANDS),
    "951KB-x4000": (lambda: scalar_bomb(951_000, 4_000), EXPANDS),
    "nested-200KB-16x16x16": (nested_scalar_bomb, EXPANDS),
    "billion-laughs": (billion_laughs, REPEATS),
}
