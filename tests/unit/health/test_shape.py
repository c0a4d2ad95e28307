"""Shape sets: the loader's rules, and the shape judge over generated answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.health.canaryset import (
    SHAPE_NOTE,
    CanaryPrompt,
    dump_canary_set,
    load_canary_set,
)
from dynamo_ftctl.health.judge import Answer, Timing, judge_shape

SHAPE = """\
kind: shape
model: m
latency_tolerance: 3
samples: 5
prompts:
  - name: a
    prompt: hello
    max_tokens: 8
    finish_reasons: [length]
    token_count: [8, 8]
    ttft_s: 0.05
    total_s: 0.2
  - name: b
    prompt: world
    max_tokens: 16
    finish_reasons: [stop, length]
    token_count: [3, 16]
    ttft_s: 0.05
    total_s: 0.4
"""


def write(tmp_path: Path, text: str) -> Path:
    """`text` as tmp_path/set.yaml."""
    path = tmp_path / "set.yaml"
    path.write_text(text)
    return path


def test_a_shape_set_loads_and_says_its_kind(tmp_path: Path) -> None:
    """A shape set loads with its shapes, tolerance and the weaker note."""
    canary_set = load_canary_set(write(tmp_path, SHAPE))
    assert canary_set.kind == "shape"
    assert canary_set.tolerance == 3.0
    assert canary_set.note == SHAPE_NOTE
    assert canary_set.prompts[1].finish_reasons == ("stop", "length")
    assert canary_set.prompts[1].token_count == (3, 16)


def test_a_set_without_kind_is_exact(tmp_path: Path) -> None:
    """Sets recorded before kinds existed are exact sets."""
    text = "model: m\nprompts:\n  - {name: a, prompt: hi, expected_text: ' x'}\n"
    assert load_canary_set(write(tmp_path, text)).kind == "exact"


def test_a_shape_set_round_trips_with_its_kind(tmp_path: Path) -> None:
    """What `record --shape` writes loads back to the same set and says `kind: shape`."""
    canary_set = load_canary_set(write(tmp_path, SHAPE))
    out = tmp_path / "out.yaml"
    dump_canary_set(canary_set, out)
    assert "kind: shape" in out.read_text()
    assert load_canary_set(out) == canary_set


@pytest.mark.parametrize(("text", "line", "key", "words"), [
    (SHAPE.replace("kind: shape", "kind: fuzzy"), 1, "kind", "'exact', 'shape'"),
    (SHAPE.replace("    token_count: [8, 8]\n", ""), 6, "prompts[0]", "missing: token_count"),
    (SHAPE.replace("    ttft_s: 0.05\n    total_s: 0.2\n", ""), 6, "prompts[0]",
     "missing: ttft_s, total_s"),
    (SHAPE.replace("[8, 8]", "[9, 9]"), 10, "prompts[0].token_count", "<= max_tokens (8)"),
    (SHAPE.replace("[8, 8]", "[0, 8]"), 10, "prompts[0].token_count[0]", ">= 1"),
    (SHAPE.replace("[3, 16]", "[7, 3]"), 17, "prompts[1].token_count", "low <= high"),
    (SHAPE.replace("ttft_s: 0.05\n    total_s: 0.2", "ttft_s: 0.5\n    total_s: 0.2"), 11,
     "prompts[0].ttft_s", "more than total_s"),
    (SHAPE.replace("ttft_s: 0.05\n    total_s: 0.2", "ttft_s: -1\n    total_s: 0.2"), 11,
     "prompts[0].ttft_s", "> 0"),
    (SHAPE.replace("finish_reasons: [length]", "finish_reasons: []"), 9,
     "prompts[0].finish_reasons", "at least 1 item"),
    (SHAPE.replace("latency_tolerance: 3", "latency_tolerance: 0.5"), 3, "latency_tolerance",
     ">= 1.0"),
    (SHAPE.replace("    finish_reasons: [length]\n",
                   "    finish_reasons: [length]\n    expected_text: hi\n"), 10,
     "prompts[0].expected_text", "judges no answer's content"),
    (SHAPE.replace("kind: shape\n", ""), 2, "latency_tolerance", "only a shape set"),
    (SHAPE.replace("kind: shape\n", "").replace("latency_tolerance: 3\nsamples: 5\n", ""), 6,
     "prompts[0].finish_reasons", "belongs to a shape set"),
])
def test_bad_shape_sets_name_file_line_and_key(
    tmp_path: Path, text: str, line: int, key: str, words: str,
) -> None:
    """Each mistake is one InventoryError line naming the file, the line and the key."""
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as info:
        load_canary_set(path)
    err = info.value
    assert (err.path, err.line, err.key) == (path, line, key)
    assert words in str(err)
    assert "\n" not in str(err)


def test_a_hostile_shape_set_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """A shape set goes through the one bounded loader: a Python tag is one error line."""
    path = write(tmp_path, SHAPE.replace("model: m", "model: !!python/object:os.system m"))
    with pytest.raises(InventoryError) as info:
        load_canary_set(path)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ the judge

reasons = st.sampled_from(["stop", "length", "abort", "content_filter", "tool_calls"])


@st.composite
def shapes(draw: st.DrawFn) -> tuple[CanaryPrompt, float]:
    """A shape prompt (any recorded reasons, range and latencies) and a tolerance."""
    max_tokens = draw(st.integers(1, 4096))
    low = draw(st.integers(1, max_tokens))
    high = draw(st.integers(low, max_tokens))
    ttft = draw(st.floats(1e-4, 100.0))
    total = draw(st.floats(ttft, 200.0))
    prompt = CanaryPrompt(
        name="p", prompt="x", max_tokens=max_tokens,
        finish_reasons=tuple(draw(st.lists(reasons, min_size=1, max_size=3, unique=True))),
        token_count=(low, high), ttft_s=ttft, total_s=total)
    return prompt, draw(st.floats(1.0, 1000.0))


@st.composite
def inside(draw: st.DrawFn) -> tuple[CanaryPrompt, float, Answer, Timing]:
    """A shape and an answer inside it (ids or a usage count; latencies within bounds)."""
    prompt, tolerance = draw(shapes())
    assert prompt.token_count is not None
    assert prompt.finish_reasons is not None
    assert prompt.ttft_s is not None
    assert prompt.total_s is not None
    count = draw(st.integers(*prompt.token_count))
    ids = draw(st.one_of(st.none(), st.just(tuple(range(count)))))
    answer = Answer(ids, draw(st.text(min_size=1, max_size=20)), None,
                    draw(st.sampled_from(prompt.finish_reasons)),
                    None if ids is not None else count)
    total = draw(st.floats(0.0, prompt.total_s * tolerance))
    ttft = draw(st.floats(0.0, min(total, prompt.ttft_s * tolerance)))
    return prompt, tolerance, answer, Timing(ttft, total)


@given(inside())
def test_an_answer_inside_the_shape_passes(case: tuple[CanaryPrompt, float, Answer, Timing],
                                           ) -> None:
    """Whatever its text: non-empty, a recorded finish, a count in range, in time: ok."""
    prompt, tolerance, answer, timing = case
    assert judge_shape(prompt, answer, timing, tolerance).kind == "ok"


@st.composite
def outside(draw: st.DrawFn) -> tuple[CanaryPrompt, float, Answer, Timing, str]:
    """An answer inside a shape, then broken one way; the verdict that way must give."""
    prompt, tolerance, answer, timing = draw(inside())
    assert prompt.token_count is not None
    assert prompt.finish_reasons is not None
    assert prompt.ttft_s is not None
    assert prompt.total_s is not None
    low, high = prompt.token_count
    ways = ["empty", "finish", "no_count", "ttft", "total"]
    if low > 1:
        ways.append("short")
    ways.append("long")
    way = draw(st.sampled_from(ways))
    if way == "empty":
        return prompt, tolerance, Answer(answer.token_ids, "", None, answer.finish_reason,
                                         answer.completion_tokens), timing, "empty_answer"
    if way == "finish":
        other = draw(st.one_of(st.none(), reasons.filter(
            lambda r: r not in (prompt.finish_reasons or ()))))
        return prompt, tolerance, Answer(answer.token_ids, answer.text, None, other,
                                         answer.completion_tokens), timing, "finish_mismatch"
    if way in ("short", "long", "no_count"):
        count = (None if way == "no_count" else draw(st.integers(0, low - 1)) if way == "short"
                 else draw(st.integers(high + 1, high + 5000)))
        return prompt, tolerance, Answer(None, answer.text, None, answer.finish_reason,
                                         count), timing, "token_count"
    limit = (prompt.ttft_s if way == "ttft" else prompt.total_s) * tolerance
    late = draw(st.floats(limit * 1.0001, limit * 100 + 1.0))
    slow = Timing(late, late) if way == "ttft" else Timing(timing.ttft_s, late)
    return prompt, tolerance, answer, slow, "slow_answer"


@given(outside())
def test_an_answer_outside_the_shape_fails_with_its_reason(
    case: tuple[CanaryPrompt, float, Answer, Timing, str],
) -> None:
    """Each way out of the shape fails, with its own kind and a one-line reason."""
    prompt, tolerance, answer, timing, kind = case
    verdict = judge_shape(prompt, answer, timing, tolerance)
    assert verdict.kind == kind
    assert verdict.reason
    assert "\n" not in verdict.reason


def ftctl(*args: str) -> tuple[int, str]:
    """Run ftctl in a subprocess (bounded): exit code and stderr."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**os.environ, "NO_COLOR": "1", "FTCTL_NO_CACHE": "1"})
    return proc.returncode, proc.stderr


def test_a_bad_shape_set_is_exit_two_with_one_line(tmp_path: Path) -> None:
    """The one-shot probe refuses a shape set missing a key before sending anything."""
    path = write(tmp_path, SHAPE.replace("    token_count: [8, 8]\n", ""))
    code, stderr = ftctl("canary", "--url", "http://127.0.0.1:9", "--set", str(path))
    assert code == 2
    assert stderr.splitlines() == [
        f"error: {path}:6: prompts[0]: a shape set's prompt needs finish_reasons, "
        "token_count, ttft_s, total_s; missing: token_count"]


def test_a_latency_tolerance_needs_shape(tmp_path: Path) -> None:
    """`record --latency-tolerance` without --shape is bad input (exit 2), nothing asked."""
    code, stderr = ftctl("canary", "record", "--url", "http://127.0.0.1:9", "--model", "m",
                         "-o", str(tmp_path / "s.yaml"), "--latency-tolerance", "3")
    assert code == 2
    assert "add --shape" in stderr
