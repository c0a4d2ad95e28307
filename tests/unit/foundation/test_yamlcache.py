"""The parsed-YAML cache: same answers as parsing, never stale, never a failure."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_ftctl import yamlcache
from dynamo_ftctl.documents import load_yaml_document
from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.health.canaryset import load_canary_set
from dynamo_ftctl.inventory import load_inventory

ROOT = Path(__file__).resolve().parents[3]
INVENTORY = ROOT / "examples" / "local.yaml"


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.msgpack")) if cache.exists() else []


def test_a_clean_document_is_stored_and_read_back_alike(cache: Path) -> None:
    """The second load comes from the cache and equals the first, line map included."""
    first_data, first = load_yaml_document(INVENTORY)
    assert len(_entries(cache)) == 1
    assert yamlcache.lookup(INVENTORY.read_text()) == (first_data, first.lines)
    second_data, second = load_yaml_document(INVENTORY)
    assert (second_data, second.lines) == (first_data, first.lines)
    assert load_inventory(INVENTORY) == load_inventory(INVENTORY)
    assert cache.stat().st_mode & 0o777 == 0o700


def test_a_cached_probe_does_not_import_pyyaml(cache: Path) -> None:
    """Once the inventory and the set are cached, loading them again skips PyYAML."""
    code = ("import sys\n"
            "from dynamo_ftctl.inventory import load_inventory\n"
            "from dynamo_ftctl.health.canaryset import load_canary_set\n"
            f"inv = load_inventory({str(INVENTORY)!r})\n"
            "load_canary_set(inv.resolve(inv.canary.set))\n"
            "print('yaml' in sys.modules)\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parents[1])}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, check=True, env=env).stdout.strip() for _ in range(2)]
    assert runs == ["True", "False"]


def test_an_edited_file_is_parsed_again(cache: Path, tmp_path: Path) -> None:
    """Entries are named by content: a change is never answered from the old entry."""
    path = tmp_path / "set.yaml"
    path.write_text("model: m\nprompts:\n  - {name: a, prompt: hi, expected_text: x}\n")
    assert load_canary_set(path).prompts[0].expected_text == "x"
    path.write_text("model: m\nprompts:\n  - {name: a, prompt: hi, expected_text: y}\n")
    assert load_canary_set(path).prompts[0].expected_text == "y"
    assert len(_entries(cache)) == 2


def test_validation_errors_name_the_same_line_from_the_cache(cache: Path, tmp_path: Path) -> None:
    """A document that parses but does not validate fails alike, cached or not."""
    bad = tmp_path / "set.yaml"
    bad.write_text("model: m\nprompts:\n  - name: a\n    prompt: hi\n    max_tokns: 3\n")
    messages = []
    for _ in range(2):
        with pytest.raises(InventoryError) as err:
            load_canary_set(bad)
        messages.append(str(err.value))
    assert len(_entries(cache)) == 1
    assert messages[0] == messages[1]
    assert f"{bad}:5: prompts[0].max_tokns: unknown key" in messages[0]


def test_syntax_errors_and_duplicate_keys_are_not_stored(cache: Path, tmp_path: Path) -> None:
    """Only documents that parsed cleanly are kept."""
    for text in ("a: [1, 2\n", "a: 1\na: 2\n"):
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(InventoryError):
            load_yaml_document(path)
    assert _entries(cache) == []


def test_non_plain_documents_are_not_stored(cache: Path) -> None:
    """Dates, binary and sets would not come back from msgpack as they were: not kept
    (the loader builds none of them any more; `store` refuses them all the same)."""
    for data in ({"when": datetime.date(2026, 11, 23)}, {"blob": b"hi"}, {"s": {"a"}}):
        yamlcache.store(repr(data), data, {})
    assert _entries(cache) == []


def test_a_corrupt_entry_is_a_miss(cache: Path) -> None:
    """Garbage in an entry is ignored; the file is parsed as if there were no cache."""
    expected, _ = load_yaml_document(INVENTORY)
    (entry,) = _entries(cache)
    entry.write_bytes(b"\xc1 not msgpack")
    data, _ = load_yaml_document(INVENTORY)
    assert data == expected


def test_a_directory_others_may_write_is_not_used(cache: Path) -> None:
    """Entries in a group- or world-writable directory could be anyone's: neither read nor written."""
    load_yaml_document(INVENTORY)
    (entry,) = _entries(cache)
    cache.chmod(0o777)
    try:
        assert yamlcache.lookup(INVENTORY.read_text()) is None
        entry.unlink()
        load_yaml_document(INVENTORY)
        assert _entries(cache) == []
    finally:
        cache.chmod(0o700)


def test_no_cache_env_and_unwritable_home_change_nothing(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FTCTL_NO_CACHE=1 writes nothing; a cache path that cannot be created is no error."""
    monkeypatch.setenv("FTCTL_NO_CACHE", "1")
    assert load_yaml_document(INVENTORY)[0]["cluster"]
    assert _entries(cache) == []
    monkeypatch.delenv("FTCTL_NO_CACHE")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where a directory must go
    assert load_yaml_document(INVENTORY)[0]["cluster"]


def test_the_oldest_entries_go_past_the_limit(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most MAX_ENTRIES entries are kept; the newest survive."""
    monkeypatch.setattr(yamlcache, "MAX_ENTRIES", 3)
    path = tmp_path / "doc.yaml"
    for i in range(6):
        path.write_text(f"n: {i}\n")
        load_yaml_document(path)
        entry = cache / yamlcache._name(path.read_text())
        os.utime(entry, (i, i))  # distinct mtimes, oldest first
    assert len(_entries(cache)) == 3
    for i in range(3, 6):
        assert yamlcache.lookup(f"n: {i}\n") == ({"n": i}, {(): 1, ("n",): 1})
