"""Typed file formats: `StrictStruct`, the checks types cannot express, and conversion
of plain data whose errors name `file:line: key`.

Every file ftctl reads (inventory, canary sets, drill scenarios, engine configs,
calibrations, prompt files) is a frozen `msgspec.Struct` built on `StrictStruct`:
unknown keys are refused, bounds are `Meta` constraints, and checks across fields
run in `__post_init__` and raise `KeyedValueError` naming the key below the struct.
`load_struct` reads a file (`documents`: bounded, with the line of every key) and
converts it; `convert_struct` converts data already read. A `msgspec.ValidationError`
becomes one `InventoryError` line: `ftctl.yaml:12: workers[2].url: not a valid
http(s) URL`.

msgspec, not pydantic: probes and engine entrypoints load these files, and msgspec's
import and validation cost a small part of pydantic's import, plugin scan and schema
build (`benchmarks/startup.py`; the figures in docs/benchmarks.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from dynamo_ftctl.documents import Located, format_key_path, load_yaml_document
from dynamo_ftctl.errors import InventoryError

__all__ = [
    "KeyedValueError",
    "StrictStruct",
    "check_host_port",
    "check_http_url",
    "check_name",
    "close_matches",
    "convert_struct",
    "doc",
    "load_struct",
    "msgspec_error_to_inventory_error",
    "replace",
    "to_data",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


class KeyedValueError(ValueError):
    """A check in a struct's `__post_init__` failed on one key below that struct (`loc`)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def close_matches(word: str, choices: Sequence[str], n: int = 1) -> list[str]:
    """Up to `n` of `choices` close to `word` (for "did you mean" hints)."""
    # difflib costs ~10 ms to import and is needed only on the error path.
    import difflib

    return difflib.get_close_matches(word, choices, n=n)


def check_http_url(value: str) -> str:
    """An http(s) URL without its trailing slash; ValueError otherwise."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or (port is not None and not 0 < port < 65536)
        or any(c.isspace() for c in value)
    ):
        msg = f"not a valid http(s) URL: {value!r}"
        raise ValueError(msg)
    return value.rstrip("/")


def check_name(value: str) -> str:
    """A worker, group or cluster name; ValueError otherwise."""
    if not _NAME.match(value):
        msg = f"invalid name {value!r}: use letters, digits, '.', '_' or '-' (at most 63)"
        raise ValueError(msg)
    return value


def check_host_port(value: str) -> str:
    """A HOST:PORT listen address; ValueError otherwise."""
    match = _HOST_PORT.match(value)
    if match is None or not 0 <= int(match.group(2)) < 65536:
        msg = f"expected HOST:PORT, got {value!r}"
        raise ValueError(msg)
    return value


_M = TypeVar("_M", bound="StrictStruct")
_T = TypeVar("_T", bound=msgspec.Struct)


class StrictStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A frozen struct that refuses unknown keys: the base of every file format.

    Checks that types cannot express run in `__post_init__`: `_checked` names
    fields and their string checks; subclasses add cross-field rules there.
    """

    # (field name, check) pairs; a tuple field's items are checked one by one.
    _checked: ClassVar[tuple[tuple[str, Callable[[str], str]], ...]] = ()

    def __post_init__(self) -> None:
        for name, check in self._checked:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, tuple):
                checked: Any = tuple(_at(check, item, (name, i)) for i, item in enumerate(value))
            else:
                checked = _at(check, value, (name,))
            if checked != value:
                msgspec.structs.force_setattr(self, name, checked)


def _at(check: Callable[[str], str], value: str, loc: tuple[str | int, ...]) -> str:
    try:
        return check(value)
    except ValueError as exc:
        raise KeyedValueError(loc, str(exc)) from None


def replace(struct: _T, **changes: Any) -> _T:
    """A copy of `struct` with `changes` (not re-validated); what it carries besides its
    fields (an inventory's source file) comes along."""
    copy = msgspec.structs.replace(struct, **changes)
    extra = getattr(struct, "__dict__", None)
    if extra:
        copy.__dict__.update(extra)
    return copy


def to_data(struct: msgspec.Struct, *, exclude_none: bool = False) -> dict[str, Any]:
    """`struct` as JSON-shaped data with the file's key names (`convert_struct` reads it
    back); with `exclude_none`, keys whose value is None are left out."""
    data: dict[str, Any] = _plain(msgspec.to_builtins(struct, enc_hook=str), exclude_none)
    return data


def _plain(value: Any, exclude_none: bool) -> Any:
    """JSON-shaped data: tuples become lists; with `exclude_none`, None values go."""
    if isinstance(value, dict):
        return {
            k: _plain(v, exclude_none) for k, v in value.items()
            if v is not None or not exclude_none
        }
    if isinstance(value, list | tuple):
        return [_plain(v, exclude_none) for v in value]
    return value


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is Path:
        if isinstance(value, str) and value:
            return Path(value)
        msg = "expected a path"
        raise ValueError(msg)
    msg = f"unsupported type {kind!r}"
    raise NotImplementedError(msg)


def doc(text: str, **constraints: Any) -> Meta:
    """A field's one-line description (shown by `ftctl inventory schema`) and its bounds."""
    return Meta(description=text, **constraints)


# ---------------------------------------------------------------------------
# msgspec validation errors as file:line: key: message

_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_TYPE_WORDS = {
    "str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
    "object": "a mapping", "array": "a list", "null": "nothing", "Path": "a path",
}
_EXPECTED = re.compile(r"^Expected `([^`]*)`(?:, got `([^`]*)`)?(.*)$")


def _loc_of(path: str) -> tuple[str | int, ...]:
    """msgspec's `$.workers[2].url` -> `("workers", 2, "url")`."""
    return tuple(
        int(index) if index else key
        for key, index in _PATH_PART.findall(path.removeprefix("$"))
    )


def _field_types(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """A struct's fields by their key in the file (`model_config`, not `model_config_name`)."""
    return {f.encode_name: f.type for f in msgspec.structs.fields(struct)}


def _struct_at(
    model: type[msgspec.Struct], loc: Sequence[str | int],
) -> type[msgspec.Struct] | None:
    """The struct type that holds the value at `loc` (None when `loc` leaves the structs)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        current = _struct_in(_field_types(current).get(part))
        if current is None:
            return None
    return current if isinstance(current, type) else None


def _field_type(model: type[msgspec.Struct], loc: Sequence[str | int]) -> Any:
    """The annotation of the field at `loc` (list indices at its end are skipped)."""
    loc = list(loc)
    while loc and isinstance(loc[-1], int):
        loc.pop()
    holder = _struct_at(model, loc[:-1])
    if holder is None or not loc:
        return None
    return _field_types(holder).get(str(loc[-1]))


def _struct_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    for arg in get_args(annotation):
        found = _struct_in(arg)
        if found is not None:
            return found
    return None


def _literals(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(v for arg in get_args(annotation) for v in _literals(arg))


def _words(types: str) -> str:
    return " or ".join(_TYPE_WORDS.get(t.strip(), t.strip()) for t in types.split("|"))


def msgspec_error_to_inventory_error(
    exc: msgspec.ValidationError, model: type[msgspec.Struct], located: Located, path: Path,
) -> InventoryError:
    """A msgspec `ValidationError` as one `file:line: key: message` line."""
    text, _, where = str(exc).rpartition(" - at `")
    if not _:
        text, where = str(exc), "$`"
    loc = _loc_of(where.removesuffix("`"))
    cause = exc.__cause__
    if isinstance(cause, KeyedValueError):
        loc = (*loc, *cause.loc)
        message = str(cause)
    elif isinstance(cause, ValueError):
        message = str(cause)
    elif text.startswith("Object contains unknown field `"):
        key = text.split("`")[1]
        holder = _struct_at(model, loc)
        allowed = sorted(_field_types(holder)) if holder else []
        loc = (*loc, key)
        close = close_matches(key, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = f"unknown key{hint} (allowed: {', '.join(allowed)})"
    elif text.startswith("Object missing required field `"):
        loc = (*loc, text.split("`")[1])
        message = "missing required key"
    elif text.startswith("Invalid enum value"):
        choices = _literals(_field_type(model, loc))
        message = f"must be one of {', '.join(repr(c) for c in choices)}" if choices else text
    elif match := _EXPECTED.match(text):
        expected, got, rest = match.groups()
        if length := re.fullmatch(r" of length ([<>]=) (\d+)", rest):
            bound = "at least" if length.group(1) == ">=" else "at most"
            count = int(length.group(2))
            unit = "item" if expected == "array" else "character"
            message = f"expected {_words(expected)} of {bound} {count} {unit}{'s' * (count != 1)}"
        else:
            message = f"expected {_words(expected)}{rest}"
            if got:
                message += f", got {_words(got)}"
    else:
        message = text
    return InventoryError(
        message, path=path, line=located.line_of(loc), key=format_key_path(loc) or None,
    )


_S = TypeVar("_S", bound=msgspec.Struct)


def convert_struct(
    data: Any, model: type[_S], located: Located | None = None, path: Path | str = "<data>",
) -> _S:
    """Validate plain data into `model`; errors are one `InventoryError` line."""
    try:
        return msgspec.convert(data, model, strict=False, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        where = located if located is not None else Located(data, {})
        raise msgspec_error_to_inventory_error(exc, model, where, Path(path)) from None




def load_struct(path: Path | str, model: type[_S], *, what: str = "a mapping") -> _S:
    """Read the YAML (or JSON) mapping in `path` within `documents`' bounds and convert it
    to `model`; every error is one `InventoryError` naming the file, line and key.

    The one loader of every file format: inventories, canary sets, drill scenarios,
    engine configs and calibrations.
    """
    path = Path(path)
    _, located = load_yaml_document(path, what=what)
    return convert_struct(located.data, model, located, path)
