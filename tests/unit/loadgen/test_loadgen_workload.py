"""Request bodies, prompt files, durations and lengths as the CLI writes them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.loadgen.config import Length, Workload, parse_duration, parse_length
from dynamo_ftctl.loadgen.workload import PRIORITY_HEADER, RequestFactory, load_prompts


@pytest.mark.parametrize(("text", "seconds"), [
    ("60", 60.0), ("60s", 60.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("1.5s", 1.5),
])
def test_parse_duration_accepts_units(text, seconds):
    """Durations take seconds or a unit (ms, s, m, h)."""
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5x", "-1s", "abc", "1e3"])
def test_parse_duration_refuses_garbage(text):
    """Anything else is invalid input naming the flag."""
    with pytest.raises(InvalidInput, match="--duration"):
        parse_duration(text, what="--duration")


def test_parse_length_fixed_and_range():
    """`128` is fixed; `64-256` a uniform range; `9-3` is refused."""
    assert parse_length("128") == Length(128, 128)
    assert parse_length("64-256") == Length(64, 256)
    with pytest.raises(InvalidInput):
        parse_length("9-3")


def test_synthetic_prompt_has_exact_byte_length_and_options():
    """A synthetic prompt is exactly N ASCII bytes; options land in the body and headers."""
    wl = Workload(prompt_tokens=Length.fixed(77), max_tokens=Length.fixed(9), stream=True,
                  ignore_eos=True, min_tokens=9, priority="high")
    factory = RequestFactory(wl, ("http://h:1/",), seed=5, model="m")
    spec = factory.build(3)
    body = json.loads(spec.body)
    assert len(body["prompt"].encode()) == 77
    assert body["prompt"].isascii()
    assert body == body | {"model": "m", "max_tokens": 9, "stream": True, "ignore_eos": True,
                           "min_tokens": 9, "stream_options": {"include_usage": True}}
    assert spec.url == "http://h:1/v1/completions"
    assert spec.headers[PRIORITY_HEADER] == "high"
    assert factory.build(3).body == spec.body
    assert factory.build(4).body != spec.body


def test_chat_requests_carry_messages():
    """The chat API posts messages to /v1/chat/completions."""
    spec = RequestFactory(Workload(api="chat"), ("http://h:1",)).build(0)
    body = json.loads(spec.body)
    assert spec.url.endswith("/v1/chat/completions")
    assert body["messages"][0]["role"] == "user"
    assert "model" not in body


def test_prompt_file_lines_are_used_in_order(tmp_path: Path):
    """Prompt-file lines are sent in turn, with their own max_tokens."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"prompt": "b"}\n')
    items = load_prompts(path, trace=False)
    factory = RequestFactory(Workload(max_tokens=Length.fixed(7)), ("http://h",), items=items)
    bodies = [json.loads(factory.build(i).body) for i in range(3)]
    assert [(b["prompt"], b["max_tokens"]) for b in bodies] == [("a", 3), ("b", 7), ("a", 3)]


@pytest.mark.parametrize(("text", "where"), [
    ('{"prompt": "a"}\n{"prompt": 1}\n', ":2: prompt:"),
    ('{"prompt": "a"}\nnot json\n', ":2: not JSON"),
    ('{"prompt": "a", "colour": 1}\n', ":1: colour:"),
    ('{"max_tokens": 3}\n', ":1: prompt:"),
])
def test_bad_prompt_file_names_file_line_and_key(tmp_path: Path, text, where):
    """A bad prompt line is refused with file:line: key (exit 2)."""
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(InventoryError) as info:
        load_prompts(path, trace=False)
    assert where in str(info.value)
    assert info.value.exit_code == 2


def test_trace_needs_timestamps_and_is_sorted(tmp_path: Path):
    """Trace lines need a timestamp and are replayed in time order."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "late", "timestamp": 5}\n{"prompt": "early", "timestamp": 1}\n')
    assert [it.prompt for it in load_prompts(path, trace=True)] == ["early", "late"]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(InventoryError, match="timestamp"):
        load_prompts(path, trace=True)


def _bodies(wl: Workload, count: int, seed: int = 3) -> list[dict]:
    factory = RequestFactory(wl, ("http://a",), seed=seed, model="m")
    return [json.loads(factory.build(i).body) for i in range(count)]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_conversation_turns_extend_the_last_turns_prompt(api):
    """Turn t of a conversation repeats turn t-1's prompt, a reply of its max_tokens and a
    new user message; N conversations take turns; after K turns N new ones begin."""
    wl = Workload(api=api, conversations=3, turns=4, prompt_tokens=Length(20, 40),
                  max_tokens=Length(5, 9))
    bodies = _bodies(wl, 3 * 4 * 2)
    for conv in range(3):
        own = [bodies[turn * 3 + conv] for turn in range(4)]
        for before, after in itertools.pairwise(own):
            if api == "chat":
                grown = after["messages"]
                assert grown[:len(before["messages"])] == before["messages"]
                assert len(grown) == len(before["messages"]) + 2
                assert [m["role"] for m in grown[-2:]] == ["assistant", "user"]
                assert len(grown[-2]["content"]) == before["max_tokens"]
            else:
                assert after["prompt"].startswith(before["prompt"])
                reply = after["prompt"][len(before["prompt"]):].split("\n")[0]
                assert len(reply) == before["max_tokens"] + 1  # the space after the colon
    first_turns = [json.dumps(b.get("messages") or b["prompt"])[:60] for b in bodies[:3]]
    assert len(set(first_turns)) == 3
    fresh = bodies[12]  # the next generation's first conversation starts anew
    if api == "chat":
        assert len(fresh["messages"]) == 1
        assert fresh["messages"] != bodies[0]["messages"]
    else:
        assert fresh["prompt"].count("Assistant:") == 1
        assert fresh["prompt"] != bodies[0]["prompt"]


def test_conversations_are_deterministic_for_a_seed():
    """The same seed builds the same conversations; another seed others."""
    wl = Workload(api="chat", conversations=2, turns=3)
    assert _bodies(wl, 6) == _bodies(wl, 6)
    assert _bodies(wl, 6) != _bodies(wl, 6, seed=4)


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"conversations": 0}, "--conversations"), ({"turns": 0}, "--turns"),
    ({"conversations": 2, "prompt_file": Path("p.jsonl")}, "--conversations"),
])
def test_bad_conversation_settings_are_refused(kwargs, flag):
    """Zero conversations or turns, or conversations with a prompt file, name the flag."""
    with pytest.raises(InvalidInput, match=flag):
        Workload(**kwargs)
