"""One of each: JSON is decoded through `jsoncodec`, SSE is cut through `sse`, and HTTP
goes through `http1` (or a transport of its seam). A module of `src/` that decodes JSON
with the standard library or an untyped msgspec decoder, splits SSE events or reads
`data:` lines itself, or imports another HTTP client, is a twin, and this test names it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src" / "dynamo_ftctl"

_HTTP_CLIENTS = {"httpx", "aiohttp", "requests", "urllib3", "http.client", "urllib.request"}


def _twins(tree: ast.AST, name: str) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""]
            found += [f"{name}:{node.lineno}: imports {m}" for m in modules
                      if m in _HTTP_CLIENTS or m.split(".")[0] in {"httpx", "aiohttp"}]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        call = ast.unparse(node.func)
        if name != "jsoncodec.py" and call in {"json.loads", "json.load"}:
            found.append(f"{name}:{node.lineno}: {call}")
        if name != "jsoncodec.py" and call == "msgspec.json.Decoder" and not node.args:
            found.append(f"{name}:{node.lineno}: an untyped msgspec decoder")
        if name != "sse.py" and node.func.attr in {"startswith", "split"} and node.args \
                and isinstance(arg := node.args[0], ast.Constant) \
                and isinstance(arg.value, bytes) \
                and (arg.value.startswith(b"data:") or arg.value == b"\n\n"):
            found.append(f"{name}:{node.lineno}: SSE parsed by hand ({call}({arg.value!r}))")
    return found


def test_src_has_one_json_decoder_one_sse_decoder_and_one_http_client() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        found += _twins(ast.parse(path.read_text()), str(path.relative_to(SRC)))
    assert found == []


@pytest.mark.parametrize("planted", [
    "import json\njson.loads(b'{}')",
    "import msgspec\nmsgspec.json.Decoder()",
    "block = b''\nblock.startswith(b'data: ')",
    "body = b''\nbody.split(b'\\n\\n')",
    "import httpx",
    "from aiohttp import web",
    "import urllib.request",
])
def test_each_kind_of_twin_is_found(planted: str) -> None:
    assert _twins(ast.parse(planted), "planted.py")


def test_typed_decoders_and_the_codec_itself_are_not_twins() -> None:
    assert _twins(ast.parse("import msgspec\nmsgspec.json.Decoder(dict)"), "x.py") == []
    assert _twins(ast.parse("import json\njson.loads('1')"), "jsoncodec.py") == []


def test_tests_call_and_fake_through_the_projects_own_http() -> None:
    """Tests use `tests/fetch.py` and the project's server, not httpx or aiohttp (a
    standard-library client stays where a test wants one independent of `http1`: the
    server's own tests, the wheel's)."""
    tests = SRC.parents[1] / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        found += [hit for hit in _twins(ast.parse(path.read_text()), path.name)
                  if " imports httpx" in hit or " imports aiohttp" in hit]
    assert found == []
