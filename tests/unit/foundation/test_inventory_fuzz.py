"""Property: any mutation of a valid inventory gives exit 0, or exit 2 with exactly one line."""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_ftctl.cli.entry import main

ROOT = Path(__file__).resolve().parents[3]
BASE_TEXT = (ROOT / "examples" / "local.yaml").read_text()
BASE = yaml.safe_load(BASE_TEXT)

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
    st.text(max_size=20), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(node: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out.extend(_paths(value, (*prefix, index)))
    return out


def _run_check(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["inventory", "check", str(path)])
    return rc, out.getvalue(), err.getvalue()


def _assert_clean(rc: int, stderr: str, path: Path) -> None:
    assert rc in (0, 2), (rc, stderr)
    assert "Traceback" not in stderr
    if rc == 2:
        lines = stderr.splitlines()
        assert len(lines) == 1, stderr
        assert lines[0].startswith(f"error: {path}"), stderr
    else:
        assert stderr == ""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), value=_SCALARS, action=st.sampled_from(["set", "delete", "rename"]))
def test_structural_mutations(tmp_path: Path, seed: int, value: object, action: str) -> None:
    """Replacing, deleting or renaming any key or item never yields a traceback."""
    rng = random.Random(seed)
    doc = yaml.safe_load(BASE_TEXT)
    target = rng.choice(_paths(doc)[1:])
    parent = doc
    for part in target[:-1]:
        parent = parent[part]  # type: ignore[index]
    last = target[-1]
    if action == "set":
        parent[last] = value  # type: ignore[index]
    elif action == "delete":
        del parent[last]  # type: ignore[arg-type]
    elif isinstance(parent, dict):
        parent[f"{last}x"] = parent.pop(last)
    path = tmp_path / "mutated.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, _, err = _run_check(path)
    _assert_clean(rc, err, path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), junk=st.binary(min_size=1, max_size=8),
       action=st.sampled_from(["insert", "delete", "truncate", "swap"]))
def test_byte_mutations(tmp_path: Path, seed: int, junk: bytes, action: str) -> None:
    """Inserting bytes, cutting, truncating or swapping lines never yields a traceback."""
    rng = random.Random(seed)
    data = bytearray(BASE_TEXT.encode())
    at = rng.randrange(len(data))
    if action == "insert":
        data[at:at] = junk
    elif action == "delete":
        del data[at : at + rng.randint(1, 40)]
    elif action == "truncate":
        del data[at:]
    else:
        lines = bytes(data).splitlines(keepends=True)
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        data = bytearray(b"".join(lines))
    path = tmp_path / "mutated.yaml"
    path.write_bytes(bytes(data))
    rc, _, err = _run_check(path)
    _assert_clean(rc, err, path)
