"""Canary sets: validation with file:line: key errors, round trip through the YAML writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.health.canaryset import CanarySet, dump_canary_set, load_canary_set

ROOT = Path(__file__).resolve().parents[3]

GOOD = """\
model: m
prompts:
  - name: a
    prompt: hello
    max_tokens: 4
    expected_token_ids: [1, 2, 3, 4]
    expected_top_logprob_range: [-1.5, -0.5]
  - name: b
    prompt: world
    expected_text: " ok"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "set.yaml"
    path.write_text(text)
    return path


def test_shipped_sim_set_is_valid() -> None:
    """canaries/ftctl-sim-tiny.yaml loads and checks token ids and logprobs."""
    canary_set = load_canary_set(ROOT / "canaries" / "ftctl-sim-tiny.yaml")
    assert canary_set.model == "ftctl-sim-tiny"
    assert all(p.expected_token_ids for p in canary_set.prompts)
    assert canary_set.wants_logprobs


def test_good_set_loads(tmp_path: Path) -> None:
    """A set with ids, text and a logprob range loads with temperature 0 by default."""
    canary_set = load_canary_set(write(tmp_path, GOOD))
    assert canary_set.temperature == 0.0
    assert canary_set.prompts[0].expected_token_ids == (1, 2, 3, 4)
    assert canary_set.prompts[1].expected_text == " ok"


@pytest.mark.parametrize(("text", "line", "key", "words"), [
    (GOOD.replace("    expected_text: \" ok\"\n", ""), 8, "prompts[1]", "expected_token_ids or"),
    (GOOD.replace("max_tokens: 4", "max_tokenz: 4"), 5, "prompts[0].max_tokenz", "did you mean"),
    (GOOD.replace("[-1.5, -0.5]", "[-0.5, -1.5]"), 3, "prompts[0]", "low <= high"),
    (GOOD.replace("name: b", "name: a"), 1, None, "duplicate prompt name"),
    (GOOD.replace("model: m\n", "model: m\ntemperature: 0.7\n"), 2, "temperature", "0"),
    (GOOD.replace("max_tokens: 4", "max_tokens: 2"), 3, "prompts[0]", "max_tokens is 2"),
])
def test_bad_sets_name_file_line_and_key(
    tmp_path: Path, text: str, line: int, key: str | None, words: str,
) -> None:
    """Each mistake is one InventoryError naming the file, the line and the key."""
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as info:
        load_canary_set(path)
    err = info.value
    assert err.path == path
    assert err.line == line
    assert err.key == key
    assert words in str(err)
    assert "\n" not in str(err)


def test_missing_file_is_invalid_input(tmp_path: Path) -> None:
    """A missing set is a one-line error (exit 2), not a traceback."""
    with pytest.raises(InventoryError, match="no such file"):
        load_canary_set(tmp_path / "nope.yaml")


def test_dump_round_trips(tmp_path: Path) -> None:
    """What the recorder writes loads back to the same set."""
    canary_set = load_canary_set(write(tmp_path, GOOD))
    out = tmp_path / "out" / "again.yaml"
    dump_canary_set(canary_set, out)
    assert load_canary_set(out) == canary_set
    assert "expected_token_ids: [1, 2, 3, 4]" in out.read_text()
    assert isinstance(canary_set, CanarySet)
