"""Reading the files a user hands to ftctl, within bounds, before anything trusts them.

Every YAML and JSON file ftctl reads (inventories, canary sets, drill scenarios,
engine configs, calibrations, load reports, prompt files, fake-GPU specs) comes
through here, so that all of them share the same limits and the same one-line
errors (`InventoryError`, exit 2, naming the file and line):

- size: at most `MAX_DOCUMENT_BYTES` (1 MiB) unless the caller names its own limit;
  larger files are refused before they are read, so is binary or non-UTF-8 text;
- nesting: at most `MAX_DEPTH` levels of lists and mappings;
- YAML tags: only `!!str` (and `!!seq`, `!!map`); a value is what it reads as;
- YAML aliases: all the nodes that aliases (`*name`, and `<<: *name` merges) repeat
  come to at most `MAX_ALIAS_NODES`, and the document as its aliases expand it counts
  at most `MAX_EXPANDED_BYTES` (the UTF-8 bytes of every scalar plus `NODE_BYTES` for
  every node, an alias counted as all it repeats, aliases inside it included). A
  "billion laughs" document is a few hundred bytes whose aliases repeat aliases; one
  large anchored scalar repeated a few thousand times repeats few nodes but gigabytes.
  Both are counted here, one pass over the parser's event stream that builds nothing,
  before PyYAML composes a node tree or anything walks, validates, caches or encodes
  the expanded document.

JSON has no aliases: its bounds are the size and Python's own recursion limit,
which ends up as the same one-line error.

A YAML document is parsed once into its data and the line of every key path
(`Located`), so that a validation error anywhere below names its line; parsed
documents are remembered by content (`yamlcache`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.jsoncodec import loads

__all__ = [
    "MAX_ALIAS_NODES",
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "MAX_EXPANDED_BYTES",
    "NODE_BYTES",
    "Located",
    "check_yaml_bounds",
    "decode_text",
    "format_key_path",
    "load_json_file",
    "load_yaml_document",
    "parse_json",
    "parse_yaml",
    "read_document",
]

# A cluster inventory of 1,000 workers is ~200 KiB; anything past 1 MiB is a mistake.
MAX_DOCUMENT_BYTES = 1024 * 1024
# Our deepest schema (drill steps, canary prompts) nests 5 levels; 64 leaves room.
MAX_DEPTH = 64
# Anchors that share a header block among a few hundred workers repeat a few thousand
# nodes; a 409-byte alias bomb repeats 9**8 (43 million).
MAX_ALIAS_NODES = 10_000
# What a node costs in the expanded count besides its scalar's bytes: at least what it
# takes in msgpack (a header or a number: at most 9 bytes, and a number is one byte of
# text or more) and in compact JSON (quotes and a comma, `null`, brackets), so that the
# cache's entry and `--json` output of a document are no larger than its count.
NODE_BYTES = 8
# The expanded count of a whole document. Real files count 0.7-1.5 times their text
# (examples/, drills/, canaries/). A 1 MiB file without aliases counts at most about
# 12 MiB (`[?,?,...]`: an empty pair in a mapping for every 2 bytes of text), so no
# file is refused for its text alone, and a real one keeps 15 MiB for what its aliases
# repeat; everything after the parser (conversion, the cache's msgpack, `--json`)
# walks at most this much. A 500 KB scalar repeated by 4,000 aliases counts 2 GB: it
# is refused at its 33rd alias.
MAX_EXPANDED_BYTES = 16 * 1024 * 1024


def _size_text(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit % (1 << 20) == 0 else f"{limit:,} bytes"


def read_document(path: Path, *, limit: int = MAX_DOCUMENT_BYTES,
                  what: str = "YAML text") -> str:
    """The text of `path` (UTF-8, at most `limit` bytes, BOM removed); `InventoryError`
    naming the file otherwise (missing, a directory, too large, binary, not UTF-8)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        msg = "no such file"
        raise InventoryError(msg, path=path) from None
    except OSError as exc:
        raise InventoryError(exc.strerror or str(exc), path=path) from None
    if path.is_dir():
        msg = f"is a directory, expected {what}"
        raise InventoryError(msg, path=path)
    if size > limit:
        msg = f"file is {size:,} bytes; the limit is {limit:,} ({_size_text(limit)})"
        raise InventoryError(msg, path=path)
    try:
        with path.open("rb") as handle:
            # One byte past the limit tells a device or a growing file from a full one.
            raw = handle.read(limit + 1)
    except OSError as exc:
        raise InventoryError(exc.strerror or str(exc), path=path) from None
    if len(raw) > limit:
        msg = f"file is over {limit:,} bytes ({_size_text(limit)})"
        raise InventoryError(msg, path=path)
    return decode_text(raw, path, what=what)


def decode_text(raw: bytes, path: Path, *, what: str = "YAML text") -> str:
    """`raw` as UTF-8 text without a BOM; a NUL byte or bad UTF-8 is an `InventoryError`."""
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        msg = f"binary data (NUL byte), expected UTF-8 {what}"
        raise InventoryError(msg, path=path, line=line)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        msg = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        raise InventoryError(msg, path=path, line=line) from None
    return text.removeprefix("\ufeff")


def check_yaml_bounds(text: str, path: Path) -> None:
    """Refuse YAML `text` (named `path` in errors) that is too large, nests too deeply or
    whose aliases repeat too much (nodes, or the bytes of the expanded document), from
    its event stream alone: nothing is built, and time and memory stay linear in `text`.

    Raises `InventoryError` naming `path` and the line of the event that went past a
    bound (for aliases, the alias). Syntax errors are PyYAML's `MarkedYAMLError`, for
    the caller to word.
    """
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:  # a lone surrogate, from a caller's str
        line = text.count("\n", 0, exc.start) + 1
        msg = f"not UTF-8 text (a lone surrogate at offset {exc.start})"
        raise InventoryError(msg, path=path, line=line) from None
    if size > MAX_DOCUMENT_BYTES:
        msg = f"document is over {MAX_DOCUMENT_BYTES:,} bytes (1 MiB)"
        raise InventoryError(msg, path=path)
    import yaml

    parser = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        _scan_events(parser, path)
    finally:
        parser.dispose()


def _scan_events(parser: Any, path: Path) -> None:
    """Depth, tags and alias expansion over `parser`'s events (see `check_yaml_bounds`)."""
    import yaml

    # (nodes, bytes) of each anchored node, aliases counted expanded; an anchor names
    # the latest node that took it, and each document has its own.
    sizes: dict[str, tuple[int, int]] = {}
    # Open collections: [anchor, nodes so far, bytes so far].
    frames: list[list[Any]] = []
    repeated = 0  # nodes that aliases repeat
    expanded = 0  # the document's bytes so far, aliases expanded
    while (event := parser.get_event()) is not None:
        alias: str | None = None
        # Scalars first: most events are.
        if isinstance(event, yaml.ScalarEvent):
            if event.tag not in _TAGS:
                _refuse_tag(event, path)
            value = event.value
            nodes, size = 1, NODE_BYTES + (len(value) if value.isascii() else
                                           len(value.encode()))
            if event.anchor is not None:
                sizes[event.anchor] = (nodes, size)
        elif isinstance(event, yaml.AliasEvent):
            alias = str(event.anchor)
            if any(frame[0] == alias for frame in frames):
                msg = f"alias *{alias} refers to a node that contains it"
                raise InventoryError(msg, path=path, line=_line(event))
            # An unknown one counts as a node: the composer says it is unknown.
            nodes, size = sizes.get(alias, (1, NODE_BYTES))
            repeated += nodes
            if repeated > MAX_ALIAS_NODES:
                msg = (f"YAML aliases repeat more than {MAX_ALIAS_NODES:,} nodes "
                       f"(at *{alias}); write the values out")
                raise InventoryError(msg, path=path, line=_line(event))
        elif isinstance(event, yaml.CollectionStartEvent):
            if event.tag not in _TAGS:
                _refuse_tag(event, path)
            frames.append([event.anchor, 1, NODE_BYTES])
            if len(frames) > MAX_DEPTH:
                msg = f"nested more than {MAX_DEPTH} levels deep"
                raise InventoryError(msg, path=path, line=_line(event))
            nodes, size = 0, NODE_BYTES  # its own node; the frame adds it to its parent
        elif isinstance(event, yaml.CollectionEndEvent):
            # Its contents were counted into `expanded` as they came.
            anchor, nodes, size = frames.pop()
            if anchor is not None:
                sizes[anchor] = (nodes, size)
            if frames:
                frames[-1][1] += nodes
                frames[-1][2] += size
            continue
        elif isinstance(event, yaml.DocumentStartEvent):
            sizes.clear()
            repeated = expanded = 0
            continue
        else:  # stream and document ends
            continue
        expanded += size
        if expanded > MAX_EXPANDED_BYTES:
            at = f" (at *{alias}, {size:,} bytes)" if alias is not None else ""
            msg = (f"YAML aliases expand the document past {_size_text(MAX_EXPANDED_BYTES)}"
                   f"{at}; write the values out")
            raise InventoryError(msg, path=path, line=_line(event))
        if frames and nodes:
            frames[-1][1] += nodes
            frames[-1][2] += size


def _line(event: Any) -> int:
    return int(event.start_mark.line) + 1


# Explicit tags that build only what a plain document holds, whatever their value:
# `!!int abc`, `!!bool maybe` or `!!timestamp 2020-13-45` fail inside PyYAML's
# constructors (ValueError, KeyError), and `!!binary`, `!!set` or `!!timestamp`
# build values no ftctl file has.
_TAGS = frozenset((None, "!", "tag:yaml.org,2002:str", "tag:yaml.org,2002:seq",
                   "tag:yaml.org,2002:map"))


def _refuse_tag(event: Any, path: Path) -> None:
    shown = str(event.tag).replace("tag:yaml.org,2002:", "!!")
    msg = f"YAML tag {shown} is not supported; write the plain value"
    raise InventoryError(msg, path=path, line=_line(event))


def parse_json(text: str | bytes, path: Path, *, line: int | None = None) -> Any:
    """`text` as JSON; `InventoryError` naming `path` (and `line`) when it is not JSON or
    nests more than `MAX_DEPTH` levels."""
    try:
        doc = loads(text)
    except json.JSONDecodeError as exc:
        msg = f"not JSON: {exc.msg}"
        where = line if line is not None else exc.lineno
        raise InventoryError(msg, path=path, line=where) from None
    except ValueError as exc:  # bytes that are not UTF-8
        msg = f"not JSON: {exc}".splitlines()[0]
        raise InventoryError(msg, path=path, line=line) from None
    except RecursionError:
        too_deep = True
    else:
        too_deep = _too_deep(doc)
    if too_deep:
        msg = f"nested more than {MAX_DEPTH} levels deep"
        raise InventoryError(msg, path=path, line=line)
    return doc


def _too_deep(doc: Any) -> bool:
    """True when `doc` nests lists and mappings more than `MAX_DEPTH` levels (no recursion)."""
    todo: list[tuple[Any, int]] = [(doc, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        if depth == MAX_DEPTH:
            return True
        todo.extend((child, depth + 1) for child in node)
    return False


def load_json_file(path: Path, *, limit: int = MAX_DOCUMENT_BYTES,
                   what: str = "JSON text") -> Any:
    """The JSON document in `path`, read within `limit` bytes (see `read_document`)."""
    return parse_json(read_document(path, limit=limit, what=what), path)


# ---------------------------------------------------------------------------
# YAML with the line of every key


def format_key_path(loc: Sequence[str | int]) -> str:
    """`("workers", 2, "url")` -> `workers[2].url`; odd keys quoted: `workers[2]['a b']`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part or not part.isprintable() or any(c in part for c in " .[]'\""):
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class Located:
    """A YAML document plus the line of every key path in it."""

    def __init__(self, data: Any, lines: dict[tuple[str | int, ...], int]) -> None:
        self.data = data
        self.lines = lines

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        """The line of the deepest existing prefix of `loc`."""
        parts = tuple(loc)
        while parts:
            if parts in self.lines:
                return self.lines[parts]
            parts = parts[:-1]
        return self.lines.get(())


def _walk_lines(
    node: Any, loc: tuple[str | int, ...], lines: dict[tuple[str | int, ...], int],
    seen: set[int], path: Path,
) -> None:
    import yaml

    # Aliases reuse one node object: visiting each once keeps "billion laughs" linear.
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            line = key_node.start_mark.line + 1
            if key in keys:
                msg = f"duplicate key {key!r}"
                raise InventoryError(msg, path=path, line=line, key=format_key_path((*loc, key)))
            keys.add(key)
            lines[(*loc, key)] = line
            _walk_lines(value_node, (*loc, key), lines, seen, path)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*loc, index)] = item.start_mark.line + 1
            _walk_lines(item, (*loc, index), lines, seen, path)


_LOADER: Any = None


def _loader() -> Any:
    """PyYAML's safe loader (libyaml when present) with YAML 1.2 booleans, no timestamps.

    YAML 1.1 reads `on`, `off`, `yes`, `no`, `y`, `n` as booleans, which turns
    `canary.actions[].on` into `True` and a worker called `no` into `False`;
    here only true/false (any case) are booleans, as in YAML 1.2. Nor does a
    date-like value become a datetime (PyYAML's constructor fails on `2020-13-45`): it
    stays a string, as in YAML 1.2's core schema.
    """
    global _LOADER  # noqa: PLW0603 - built once per process, on first use
    if _LOADER is None:
        import yaml

        base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        bool_tag = "tag:yaml.org,2002:bool"
        dropped = {bool_tag, "tag:yaml.org,2002:timestamp"}
        resolvers = {
            first: [(tag, regexp) for tag, regexp in entries if tag not in dropped]
            for first, entries in base.yaml_implicit_resolvers.items()
        }
        _LOADER = type("FtctlLoader", (base,), {"yaml_implicit_resolvers": resolvers})
        _LOADER.add_implicit_resolver(
            bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"),
        )
    return _LOADER


def parse_yaml(text: str, path: Path) -> Located:
    """Parse `text` (named `path` in errors), through the content-addressed cache."""
    from dynamo_ftctl import yamlcache

    cached = yamlcache.lookup(text)
    if cached is not None:
        return Located(*cached)
    located = _parse_yaml_text(text, path)
    yamlcache.store(text, located.data, located.lines)
    return located


def _parse_yaml_text(text: str, path: Path) -> Located:
    import yaml

    try:
        # Bounds first, on events alone: an alias bomb is refused before PyYAML composes
        # it, before `_walk_lines`, validation or the cache see its expansion.
        check_yaml_bounds(text, path)
        loader = _loader()(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return Located(None, {})
            lines: dict[tuple[str | int, ...], int] = {(): node.start_mark.line + 1}
            _walk_lines(node, (), lines, set(), path)
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        msg = f"YAML syntax error: {problem}"
        raise InventoryError(msg, path=path, line=line) from None
    except yaml.YAMLError as exc:
        msg = f"YAML error: {exc}".splitlines()[0]
        raise InventoryError(msg, path=path) from None
    except RecursionError:
        msg = "YAML nested too deeply"
        raise InventoryError(msg, path=path) from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        # A constructor PyYAML did not guard; the bounds check leaves few (tags, dates).
        msg = f"YAML value ftctl cannot read: {exc}"
        raise InventoryError(msg, path=path) from None
    return Located(data, lines)


def load_yaml_document(path: Path, *, what: str = "a mapping") -> tuple[Any, Located]:
    """Read a YAML file within `documents`' bounds (1 MiB, 64 levels, aliases repeating
    at most 10,000 nodes and expanding the document to at most 16 MiB) and return
    (data, line map).

    Every YAML file format goes through here (see `structs.load_struct`), so all
    give the same one-line errors. The document must be a mapping.
    """
    located = parse_yaml(read_document(path), path)
    if located.data is None:
        msg = f"empty document, expected {what}"
        raise InventoryError(msg, path=path, line=1)
    if not isinstance(located.data, dict):
        kind = type(located.data).__name__
        kind = {"list": "a list", "str": "a string", "int": "a number"}.get(kind, kind)
        msg = f"expected {what} at the top level, got {kind}"
        raise InventoryError(msg, path=path, line=located.lines.get((), 1))
    return located.data, located
