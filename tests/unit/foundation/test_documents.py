"""Bounded reading of user files: alias bombs, deep nesting and bad JSON are one-line errors."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl import yamlcache
from dynamo_ftctl.documents import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    check_yaml_bounds,
    load_yaml_document,
    parse_json,
)
from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.faults.audit import read_audit
from dynamo_ftctl.faults.inject import pending_reverts
from dynamo_ftctl.gpu.fake import load_fake_nvml
from dynamo_ftctl.health.baseline import BaselineStore
from dynamo_ftctl.inventory import parse_inventory
from dynamo_ftctl.loadgen.compare import load_report_json
from dynamo_ftctl.loadgen.workload import load_prompts
from dynamo_ftctl.lock.flock import read_owner
from tests.unit.foundation.loaders import YAML_LOADERS

ROOT = Path(__file__).resolve().parents[3]
INVENTORY = ROOT / "examples" / "local.yaml"


def billion_laughs(levels: int = 9, width: int = 9, *, under: str = "cluster") -> str:
    """The classic: each level an anchored list of `width` aliases to the one below."""
    lines = ['l0: &l0 "lol"']
    refs = ", ".join(["*l0"] * width)
    for level in range(1, levels + 1):
        refs = ", ".join([f"*l{level - 1}"] * width)
        lines.append(f"l{level}: &l{level} [{refs}]")
    lines.append(f"{under}: *l{levels}")
    return "\n".join(lines) + "\n"


def issue_bomb() -> str:
    """An inventory with valid workers whose junk key holds 9**8 repeated scalars."""
    lines = ["cluster: demo", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, 8):
        refs = ", ".join([f"*a{level - 1}"] * 9)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append("workers: [{name: w1, url: 'http://127.0.0.1:1'}]\nx: *a7\n")
    return "\n".join(lines)


def mapping_bomb() -> str:
    """Aliases inside flow mappings (and a merge key) expand like lists do."""
    lines = ["m0: &m0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8}"]
    for level in range(1, 9):
        keys = ", ".join(f"k{i}: *m{level - 1}" for i in range(8))
        lines.append(f"m{level}: &m{level} {{<<: *m0, {keys}}}")
    lines.append("cluster: *m8")
    return "\n".join(lines) + "\n"


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.msgpack")) if cache.exists() else []


def _limits() -> None:
    # Bounds the child even where the loader is wrong: 10 s of CPU, 2 GiB of address space.
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _run_measured(argv: list[str], tmp_path: Path, env: dict[str, str]) -> tuple[int, str, float,
                                                                                int]:
    """Exit code, stderr, wall seconds and peak RSS (MiB) of `ftctl argv` in a child."""
    err_path = tmp_path / "stderr.txt"
    with err_path.open("wb") as err:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl", *argv], stdout=subprocess.DEVNULL,
            stderr=err, env=env, preexec_fn=_limits,  # noqa: PLW1509 - a test's child only
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not reap it again
    return proc.returncode, err_path.read_text(), wall, usage.ru_maxrss // 1024


@pytest.mark.parametrize("text", [billion_laughs(), issue_bomb(), mapping_bomb()],
                         ids=["billion-laughs", "issue-22", "mapping-merge"])
def test_alias_bombs_are_refused_in_bounded_time_and_memory(
    tmp_path: Path, cache: Path, text: str,
) -> None:
    """A few hundred bytes of nested aliases: exit 2, one line, < 5 s, < 400 MiB, no cache."""
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parents[1]), "FTCTL_INVENTORY": ""}
    for _ in range(2):  # the rerun too: nothing was cached by the first
        rc, stderr, wall, rss_mib = _run_measured(["-i", str(path), "inventory", "check"],
                                                  tmp_path, env)
        assert rc == 2, stderr
        assert len(stderr.splitlines()) == 1, stderr
        assert stderr.startswith(f"error: {path}:"), stderr
        assert "aliases repeat more than 10,000 nodes" in stderr
        assert wall < 5.0
        assert rss_mib < 400
        assert _entries(cache) == []


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("loader", YAML_LOADERS.values(), ids=YAML_LOADERS.keys())
def test_every_yaml_loader_refuses_a_bomb_before_caching_it(
    tmp_path: Path, cache: Path, loader: Callable[[Path], Any],
) -> None:
    """Each YAML file type refuses billion laughs in well under 2 s, caching nothing."""
    path = _write(tmp_path, "bomb.yaml", billion_laughs(under="model"))
    started = time.process_time()  # CPU time: a starved machine must not fail the bound
    with pytest.raises(InventoryError, match=r"^.*bomb\.yaml:\d+: YAML aliases repeat"):
        loader(path)
    assert time.process_time() - started < 2.0
    assert _entries(cache) == []


def test_the_bomb_line_is_the_alias_that_crosses_the_budget(tmp_path: Path) -> None:
    """The error names the line of the alias that went past the budget."""
    text = billion_laughs()
    with pytest.raises(InventoryError) as caught:
        parse_inventory(text, tmp_path / "x.yaml")
    # Lines 2-5 repeat 8,298 nodes; the first *l4 on line 6 adds 7,381 (l4 and all below).
    assert caught.value.line == 6
    assert "*l4" in str(caught.value)


def test_aliases_within_the_budget_still_load(tmp_path: Path) -> None:
    """Anchors that share a block among workers load as if written out."""
    shared = ("cluster: c\nworkers:\n"
              "  - &w {name: w1, url: 'http://127.0.0.1:1', model: m, faults: [kill, hang]}\n"
              "  - {<<: *w, name: w2, url: 'http://127.0.0.1:2'}\n")
    spelled = ("cluster: c\nworkers:\n"
               "  - {name: w1, url: 'http://127.0.0.1:1', model: m, faults: [kill, hang]}\n"
               "  - {name: w2, url: 'http://127.0.0.1:2', model: m, faults: [kill, hang]}\n")
    a = parse_inventory(shared, tmp_path / "a.yaml")
    b = parse_inventory(spelled, tmp_path / "b.yaml")
    assert a.workers == b.workers
    budget = "a: &a [" + ", ".join(["x"] * (MAX_ALIAS_NODES - 1)) + "]\nb: *a\n"
    check_yaml_bounds(budget, tmp_path / "c.yaml")  # exactly the budget: accepted


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path: Path) -> None:
    """A node that contains an alias to itself (a cycle) is one line, not a recursion."""
    with pytest.raises(InventoryError, match=r"x\.yaml:2: alias \*a refers to a node that"):
        parse_inventory("cluster: c\nworkers: &a [1, *a]\n", tmp_path / "x.yaml")


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "block"])
def test_nesting_past_the_limit_is_refused(tmp_path: Path, flow: bool) -> None:
    """64 levels of lists load; 65 are refused with the line where the 65th opens."""
    def nested(levels: int) -> str:
        if flow:
            return "cluster: " + "[" * levels + "]" * levels + "\n"
        return "cluster:\n" + "".join(" " * (2 * i) + "- \n" for i in range(levels - 1)) + \
            " " * (2 * (levels - 1)) + "- x\n"

    check_yaml_bounds(nested(MAX_DEPTH - 1), tmp_path / "ok.yaml")  # + the top mapping
    with pytest.raises(InventoryError, match=r"deep\.yaml:\d+: nested more than 64 levels"):
        check_yaml_bounds(nested(MAX_DEPTH), tmp_path / "deep.yaml")


WORKERS = "workers: [{name: w1, url: 'http://127.0.0.1:1', model: m}]\n"


def test_dates_stay_strings(tmp_path: Path) -> None:
    """A date-like value is a string (YAML 1.2): `2020-13-45` no longer fails inside PyYAML."""
    assert parse_inventory("cluster: 2024-01-01\n" + WORKERS, tmp_path / "a.yaml").cluster == \
        "2024-01-01"
    assert parse_inventory("cluster: 2020-13-45\n" + WORKERS, tmp_path / "b.yaml").cluster == \
        "2020-13-45"


@pytest.mark.parametrize("tagged", ["!!int abc", "!!bool maybe", "!!float x", "!!timestamp",
                                    "!!binary aGk=", "!!set {a: null}", "!custom x"])
def test_explicit_tags_other_than_str_are_refused(tmp_path: Path, tagged: str) -> None:
    """Tags that build values no ftctl file holds (or fail in PyYAML) are one line with
    the line number; `!!str` still forces a string."""
    with pytest.raises(InventoryError, match=r"x\.yaml:2: YAML tag .* is not supported"):
        parse_inventory(f"{WORKERS}cluster: {tagged}\n", tmp_path / "x.yaml")
    assert parse_inventory(f"cluster: !!str 1.0\n{WORKERS}", tmp_path / "y.yaml").cluster == \
        "1.0"


def test_a_lone_surrogate_in_text_is_one_line(tmp_path: Path) -> None:
    """Text from a caller (not a file) with a lone surrogate is an InventoryError."""
    with pytest.raises(InventoryError, match="lone surrogate"):
        parse_inventory("cluster: \ud800\n", tmp_path / "x.yaml")


def test_a_large_cache_entry_is_neither_written_nor_read(
    cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entries over MAX_ENTRY_BYTES are skipped both ways; the document still loads."""
    limit = yamlcache.MAX_ENTRY_BYTES
    monkeypatch.setattr(yamlcache, "MAX_ENTRY_BYTES", 64)
    data, _ = load_yaml_document(INVENTORY)
    assert _entries(cache) == []
    monkeypatch.setattr(yamlcache, "MAX_ENTRY_BYTES", limit)
    load_yaml_document(INVENTORY)
    assert len(_entries(cache)) == 1
    monkeypatch.setattr(yamlcache, "MAX_ENTRY_BYTES", 64)
    assert yamlcache.lookup(INVENTORY.read_text()) is None
    assert load_yaml_document(INVENTORY)[0] == data


# --------------------------------------------------------------------------- JSON


def test_deep_json_is_one_line(tmp_path: Path) -> None:
    """JSON nested past 64 levels, or past Python's recursion limit, is an InventoryError."""
    path = tmp_path / "x.json"
    assert parse_json("[" * 64 + "]" * 64, path) is not None
    for depth in (65, 100_000):
        with pytest.raises(InventoryError, match=r"x\.json:3: nested more than 64 levels"):
            parse_json("[" * depth + "]" * depth, path, line=3)
    assert parse_json("null", path) is None


JSON_LOADERS: dict[str, Callable[[Path], Any]] = {
    "load report": load_report_json,
    "prompt file": lambda p: load_prompts(p, trace=False),
    "fake nvml": load_fake_nvml,
}


@pytest.mark.parametrize("loader", JSON_LOADERS.values(), ids=JSON_LOADERS.keys())
@pytest.mark.parametrize("content", [
    b"[" * 100_000, b'{"a": ' * 5000, b"\xff\xfe", b"\x00", b"", b"[1, 2",
], ids=["deep-list", "deep-object", "not-utf8", "nul", "empty", "cut"])
def test_json_loaders_refuse_bad_files_in_one_line(
    tmp_path: Path, loader: Callable[[Path], Any], content: bytes,
) -> None:
    """Deep, binary, empty or cut JSON files are an `InvalidInput` naming the file."""
    path = tmp_path / "in.json"
    path.write_bytes(content)
    with pytest.raises(InvalidInput, match=r"in\.json") as caught:
        loader(path)
    assert "\n" not in str(caught.value)


def test_fake_nvml_refuses_a_billion_gpus(tmp_path: Path) -> None:
    """A spec asking for more GPUs than any node has is refused, not allocated."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"gpus": 10**9}))
    with pytest.raises(InvalidInput, match="at most 256"):
        load_fake_nvml(path)


# ------------------------------------------------------- files ftctl reads back


def test_a_deep_canary_state_file_is_rebuilt(tmp_path: Path) -> None:
    """The probes' baseline file is a cache: nested too deep or too large, it starts over."""
    path = tmp_path / "canary.json"
    path.write_text("[" * 100_000)
    assert BaselineStore(path).load().entries == {}
    path.write_bytes(b" " * (16 * 1024 * 1024 + 1))
    assert BaselineStore(path).load().entries == {}


def test_a_deep_lock_file_reads_as_no_owner_data(tmp_path: Path) -> None:
    """4 KiB of "[" in a lock file is owner data ftctl cannot read, not a traceback."""
    path = tmp_path / "x.lock"
    path.write_text("[" * 4000)
    assert read_owner(path) is None  # free, and no owner data worth showing


def test_revert_records_that_are_not_objects_are_left_alone(tmp_path: Path) -> None:
    """Pending reverts skip files that are deep, not JSON or not an object."""
    folder = tmp_path / "reverts"
    folder.mkdir()
    (folder / "a.json").write_text("[" * 100_000)
    (folder / "b.json").write_text("[1, 2]")
    (folder / "c.json").write_text('{"id": "c"}')
    assert [r["id"] for r in pending_reverts(tmp_path)] == ["c"]


def test_an_audit_line_that_is_not_a_record_names_its_line(tmp_path: Path) -> None:
    """read_audit: a line that is not a JSON object is an error naming file and line."""
    path = tmp_path / "audit.jsonl"
    path.write_text('{"what": "kill"}\n\n' + "[" * 100_000 + "\n")
    with pytest.raises(InventoryError, match=r"audit\.jsonl:3: nested more than 64"):
        read_audit(path)
    path.write_text('{"what": "kill"}\n7\n')
    with pytest.raises(InventoryError, match=r"audit\.jsonl:2: expected a JSON object"):
        read_audit(path)
