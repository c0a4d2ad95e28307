"""Docstrings and comments state contracts; where a rule came from lives in docs/.

No docstring or comment under src/ cites an issue or a task by number (`#29`,
`issue 33`, `task 12`): the code says what it does and promises, and
docs/history.md and the commit log say where it came from. A hex colour (`#1f77b4`)
is not a citation, nor is a URL to another project's issue, which stays a source.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import dynamo_ftctl

SRC = Path(dynamo_ftctl.__file__).parent

# `#29` (not `#1f77b4`, not a URL's `/#3` or an HTML `&#39;`), `issue 33`, `Issue #7`,
# `issues 3 and 4`, `task 12`.
ISSUE_REFERENCE = re.compile(
    r"(?<![\w&/#])#\d{1,5}(?!\w)|\b(?:issues?|tasks?)\s+#?\d+\b", re.IGNORECASE)


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every module, class and function docstring and every comment."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def issue_references(source: str) -> list[tuple[int, str]]:
    """(line, citation) of each issue or task number cited in `source`'s prose, in order."""
    found = [
        (line + text.count("\n", 0, match.start()), match.group())
        for line, text in prose(source)
        for match in ISSUE_REFERENCE.finditer(text)
    ]
    return sorted(found)


PLANTED = '''\
"""A module fixed in #29; see issue 33.

Issues 3 and 4 are the same bug."""
# task 12 moved this here
BLUE = "#1f77b4"  # matplotlib's blue, #1f77b4; see design.md#layers
ESCAPED = "&#39;"  # an HTML apostrophe, &#39;


def f() -> None:
    """Cites https://github.com/vllm-project/vllm/issues/17448 and Issue #7."""
'''


def test_the_check_finds_what_was_planted() -> None:
    """Planted citations are found on their lines; colours, anchors, entities and URLs are not."""
    assert issue_references(PLANTED) == [
        (1, "#29"), (1, "issue 33"), (3, "Issues 3"), (4, "task 12"), (10, "Issue #7"),
    ]


def test_no_docstring_or_comment_cites_an_issue() -> None:
    """No docstring or comment in dynamo_ftctl cites an issue or task by number."""
    found = [
        f"{path.relative_to(SRC.parent)}:{line}: {citation}"
        for path in sorted(SRC.rglob("*.py"))
        for line, citation in issue_references(path.read_text(encoding="utf-8"))
    ]
    assert not found, ("issue citations belong in docs/history.md or the commit log, "
                       "not in the code:\n" + "\n".join(found))
