"""Parsed YAML remembered by content, so that an exec probe skips PyYAML.

A Kubernetes exec probe re-reads the same inventory and canary set every few
seconds within a 150 ms budget, of which importing PyYAML alone would take a tenth
(docs/benchmarks.md, startup.py). A document that parsed cleanly
is kept, with the line of every key (for error messages), as msgpack under
`$XDG_CACHE_HOME/ftctl/yaml/` (default `~/.cache/ftctl/yaml/`), named by a
hash of its text and of the loader's version: an edited file hashes to a new
name, so an entry is never stale, and validation still runs on every load.

Only documents that passed `documents.check_yaml_bounds` reach `store` (at most
1 MiB of text, 64 levels, aliases repeating at most 10,000 nodes and expanding the
document to at most 16 MiB), so an entry holds no alias bomb's expansion. msgpack
has no aliases: a subtree the document shares is written out at each place, so
`store` first sizes the entry as msgpack will write it, walking shared subtrees
once per reference and stopping at `MAX_ENTRY_BYTES`; only plain documents
(mappings, lists, strings, numbers, booleans, null) within that size are encoded
and kept, whatever the caller hands it. A larger entry is neither written nor read.
The cache never fails a command: an entry it cannot read back, a directory that
is not the user's own or that others may write, a read-only home, all count as
a miss. At most `MAX_ENTRIES` entries are kept, the least recently written go
first. `FTCTL_NO_CACHE=1` turns the cache off.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import msgspec

from dynamo_ftctl import __version__

try:  # what hashlib.blake2b is, without hashlib's import of OpenSSL
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - CPython always builds _blake2
    from hashlib import blake2b

__all__ = ["MAX_ENTRIES", "MAX_ENTRY_BYTES", "Lines", "cache_dir", "lookup", "store"]

# Bump when the YAML loader's output for the same text changes (booleans, tags).
# 2: documents are bounded before they are cached; a format-1 entry may hold the
# expansion of an alias bomb, and is never read again. Dates stay strings.
# 3: documents are bounded in expanded bytes too; older entries are not.
FORMAT = 3
MAX_ENTRIES = 256
# A 1 MiB inventory of 1,000 workers packs to ~0.5 MiB with its line map.
MAX_ENTRY_BYTES = 8 * 1024 * 1024

Lines = dict[tuple[str | int, ...], int]
_Entry = tuple[Any, list[tuple[list[str | int], int]]]


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off."""
    from dynamo_ftctl.safefiles import user_cache_dir

    return user_cache_dir("yaml")


def _name(text: str) -> str:
    digest = blake2b(f"ftctl {__version__} yaml/{FORMAT}\n{text}".encode(), digest_size=20)
    return digest.hexdigest() + ".msgpack"


def _trusted(directory: Path) -> bool:
    """Ours alone: owned by this user and writable by no one else."""
    try:
        info = directory.stat()
    except OSError:
        return False
    return info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def lookup(text: str) -> tuple[Any, Lines] | None:
    """The data and line map stored for `text`, or None."""
    directory = cache_dir()
    if directory is None or not _trusted(directory):
        return None
    try:
        with (directory / _name(text)).open("rb") as handle:
            blob = handle.read(MAX_ENTRY_BYTES + 1)
        if len(blob) > MAX_ENTRY_BYTES:
            return None
        data, pairs = msgspec.msgpack.decode(blob, type=_Entry)
    except (OSError, msgspec.DecodeError, ValueError):
        return None
    return data, {tuple(path): line for path, line in pairs}


def _packed_size(data: Any) -> int | None:
    """At least the size of `data` in msgpack, or None when `data` is not plain (see the
    module docstring), nests past 64 levels or would pack to over `MAX_ENTRY_BYTES`.

    A subtree referenced from many places counts at each, as msgpack writes it; the
    walk stops as soon as the count passes the limit, so it takes time and memory in
    proportion to the limit, not to the expanded document.
    """
    total = 0
    todo: list[tuple[Any, int]] = [(data, 0)]
    while todo:
        value, depth = todo.pop()
        # msgpack's headers are at most 5 bytes (32-bit lengths); numbers at most 9.
        if isinstance(value, str):
            try:
                total += 5 + len(value.encode())
            except UnicodeEncodeError:  # a lone surrogate: msgpack would refuse it
                return None
        elif value is None or isinstance(value, int | float):  # bool is an int
            total += 9
        elif depth > 64:
            return None
        elif isinstance(value, list):
            total += 5
            todo.extend((item, depth + 1) for item in value)
        elif isinstance(value, dict):
            total += 5
            for key, item in value.items():
                if not isinstance(key, str | int) or isinstance(key, bool):
                    return None
                todo.append((key, depth + 1))
                todo.append((item, depth + 1))
        else:  # dates, binary, sets: msgpack would not give them back as they were
            return None
        if total > MAX_ENTRY_BYTES:
            return None
    return total


def store(text: str, data: Any, lines: Lines) -> None:
    """Keep a cleanly parsed document (best effort: any failure is ignored)."""
    directory = cache_dir()
    if directory is None or _packed_size(data) is None:
        return
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _trusted(directory):
            return
        blob = msgspec.msgpack.encode((data, [(list(k), v) for k, v in lines.items()]))
        if len(blob) > MAX_ENTRY_BYTES:
            return
        target = directory / _name(text)
        from dynamo_ftctl.errors import FtctlError
        from dynamo_ftctl.safefiles import write_atomic

        try:
            write_atomic(target, blob, mode=0o600, follow_link=False)  # temp + rename
        except FtctlError:  # a link, FIFO or device planted in the cache: not cached
            return
        _prune(directory)
    except (OSError, TypeError, ValueError, OverflowError):
        return


def _prune(directory: Path) -> None:
    entries = [(e.stat().st_mtime, e.path) for e in os.scandir(directory)
               if e.name.endswith(".msgpack")]
    for _, path in sorted(entries)[:-MAX_ENTRIES]:
        Path(path).unlink(missing_ok=True)
