"""The expanded-size budget of YAML documents: what it counts, where it refuses, and that
neither the loader nor the parse cache ever holds or encodes more than it allows."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dynamo_ftctl import documents, yamlcache
from dynamo_ftctl.documents import (
    MAX_DOCUMENT_BYTES,
    MAX_EXPANDED_BYTES,
    NODE_BYTES,
    check_yaml_bounds,
    parse_yaml,
)
from dynamo_ftctl.errors import InventoryError
from tests.unit.foundation.bombs import EXPANDS, REPEATS, scalar_bomb


def _exact(filler: int) -> str:
    """A 500,000-byte scalar and 32 aliases to it, then a scalar of `filler` bytes."""
    return ("a: &a " + "x" * 500_000 + "\nb: [" + ", ".join(["*a"] * 32) + "]\n"
            "c: " + "y" * filler + "\n")


def test_the_count_is_scalar_bytes_plus_8_a_node_and_the_budget_is_inclusive(
    tmp_path: Path,
) -> None:
    """A document that counts exactly the budget loads; one byte more is refused at the
    scalar that crosses it (line 3, no alias to name)."""
    # The top mapping, keys a, b and c, the list; the scalar and its 32 aliases; y...
    fixed = NODE_BYTES * 5 + 3 + 33 * (NODE_BYTES + 500_000)
    filler = MAX_EXPANDED_BYTES - fixed - NODE_BYTES
    check_yaml_bounds(_exact(filler), tmp_path / "ok.yaml")
    with pytest.raises(InventoryError) as caught:
        check_yaml_bounds(_exact(filler + 1), tmp_path / "over.yaml")
    assert caught.value.line == 3
    assert str(caught.value).endswith(f"over.yaml:3: {EXPANDS}; write the values out")


def test_the_error_names_the_alias_that_crosses_the_budget(tmp_path: Path) -> None:
    """The 500 KB x 4,000 file is refused at its 33rd alias (line 35), which it names."""
    with pytest.raises(InventoryError) as caught:
        parse_yaml(scalar_bomb(500_000, 4_000), tmp_path / "x.yaml")
    # 500,044 for the scalar, its key, x and the list; 500,008 an alias; 16 MiB is
    # passed by the 33rd, on line 2 + 33.
    assert caught.value.line == 35
    assert f"{EXPANDS} (at *big, 500,008 bytes)" in str(caught.value)


@pytest.mark.parametrize("text", [
    "[" + ",".join(["{" + ",".join("abcdefghijklmnopqrstuvwxyz") + "}"] * 19_000) + "]",
    "[" + ",".join(["1"] * (MAX_DOCUMENT_BYTES // 2 - 1)) + "]",
    "-\n" * (MAX_DOCUMENT_BYTES // 2),
], ids=["flow-keys", "flow-list", "block-list"])
def test_no_file_is_refused_for_its_text_alone(tmp_path: Path, text: str) -> None:
    """The densest 1 MiB files without aliases (most nodes a byte) stay under the budget."""
    assert len(text) <= MAX_DOCUMENT_BYTES
    check_yaml_bounds(text, tmp_path / "dense.yaml")


def test_the_cache_never_encodes_an_expanded_document(cache: Path) -> None:
    """Handed data whose shared subtree expands to 100 MB, `store` sizes it, stops at
    the entry limit and writes nothing, in bounded memory and time."""
    data = {"x": ["y" * 100_000] * 1_000}  # one string, 1,000 references
    tracemalloc.start()
    started = time.process_time()  # CPU time: a starved machine must not fail the bound
    try:
        yamlcache.store("x: [...]\n", data, {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.process_time() - started < 1.0
    assert peak < 2 * yamlcache.MAX_ENTRY_BYTES
    assert not list(cache.glob("*.msgpack"))


# --------------------------------------------------------------------------- property

# Small, so that generated documents fall on both sides of both bounds.
BUDGET = 40_000
NODES = 400

SCALARS = st.one_of(
    st.builds(lambda c, n: f"'{c * n}'", st.sampled_from("abz -_."),
              st.sampled_from([0, 1, 7, 300, 3_000, 9_000])),
    st.integers(-10**12, 10**12).map(str),
    st.sampled_from(["~", "null", "true", "False", "1.5", "-0.25", ".inf", "0x1F", "word"]),
)


@st.composite
def anchored_yaml(draw: st.DrawFn) -> str:
    """Anchored scalars, lists and mappings, each made of scalars and aliases to the
    ones before (mappings also merge one with `<<`), and a top key aliasing some."""
    kinds: list[str] = []
    lines: list[str] = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["scalar", "list", "map"]))
        refs = st.sampled_from([f"*a{j}" for j in range(i)]) if i else SCALARS
        count = draw(st.sampled_from([0, 1, 3, 8, 12]))
        items = [draw(st.one_of(refs, SCALARS)) for _ in range(count)]
        if kind == "scalar":
            body = draw(SCALARS)
        elif kind == "list":
            body = "[" + ", ".join(items) + "]"
        else:
            pairs = [f"k{n}: {item}" for n, item in enumerate(items)]
            maps = [f"*a{j}" for j, k in enumerate(kinds) if k == "map"]
            if maps and draw(st.booleans()):
                pairs.insert(0, f"<<: {draw(st.sampled_from(maps))}")
            body = "{" + ", ".join(pairs) + "}"
        kinds.append(kind)
        lines.append(f"a{i}: &a{i} {body}")
    top = [f"*a{j}" for j in range(len(kinds))
           for _ in range(draw(st.sampled_from([0, 1, 4])))]
    lines.append("top: [" + ", ".join(top) + "]")
    return "\n".join(lines) + "\n"


def _parse(text: str, path: Path) -> tuple[object, object] | str:
    try:
        located = parse_yaml(text, path)
    except InventoryError as exc:
        return exc.reason
    return located.data, located.lines


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(text=anchored_yaml())
def test_a_document_is_refused_or_within_the_budget_and_cached_alike(
    cache: Path, tmp_path: Path, text: str,
) -> None:
    """Either an alias bound refuses the document, or its compact JSON is within the
    budget; the cached load (first and second) equals the uncached one."""
    path = tmp_path / "doc.yaml"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(documents, "MAX_EXPANDED_BYTES", BUDGET)
        patch.setattr(documents, "MAX_ALIAS_NODES", NODES)
        patch.setenv("FTCTL_NO_CACHE", "1")
        uncached = _parse(text, path)
        patch.delenv("FTCTL_NO_CACHE")
        first, second = _parse(text, path), _parse(text, path)
    assert first == second == uncached
    if isinstance(uncached, str):
        assert uncached.startswith((EXPANDS.replace("16 MiB", f"{BUDGET:,} bytes"),
                                    REPEATS.replace("10,000", str(NODES)))), uncached
        assert yamlcache.lookup(text) is None
        event(uncached.split(" (")[0])
    else:
        data = uncached[0]
        size = len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode())
        assert size <= BUDGET
        assert yamlcache.lookup(text) == uncached
        event("loaded and cached")
