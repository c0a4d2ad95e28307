"""Where fault injection keeps its records: the audit log and pending reverts.

Both live under `$XDG_STATE_HOME/ftctl` (default `~/.local/state/ftctl`):
`audit.jsonl` gets one JSON line per injection or revert (who, when, what,
target, result), appended with a single `write` so concurrent injectors never
interleave lines; `reverts/<id>.json` holds the revert steps of a fault that
is still in force, written *before* the fault is applied, so an injector that
crashes or is killed leaves what `ftctl inject revert --all` needs.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dynamo_ftctl.documents import parse_json, read_document
from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.output import to_jsonable
from dynamo_ftctl.safefiles import append_log, write_atomic

__all__ = [
    "AuditRecord",
    "append_audit",
    "default_audit_path",
    "default_state_dir",
    "read_audit",
    "who_am_i",
]

# A record is ~300 bytes: 256 MiB is close to a million injections.
_MAX_AUDIT_BYTES = 256 * 1024 * 1024


def default_state_dir() -> Path:
    """`$XDG_STATE_HOME/ftctl`, else `~/.local/state/ftctl`."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ftctl"


def default_audit_path() -> Path:
    """The audit log used when `--audit-log` is not given."""
    return default_state_dir() / "audit.jsonl"


def who_am_i() -> str:
    """`user@host` of the operator (the audit log's "who")."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class AuditRecord:
    """One audit line: who did what to which target, when, and how it went."""

    who: str
    when: str
    what: str
    target: str
    result: str
    action: str = "inject"
    detail: tuple[str, ...] = ()

    @staticmethod
    def now(wall: float) -> str:
        """An ISO-8601 UTC timestamp for `wall` seconds since the epoch."""
        return datetime.fromtimestamp(wall, tz=UTC).isoformat(timespec="milliseconds")


def append_audit(path: Path, record: AuditRecord) -> None:
    """Append one JSON line (one `write` on an O_APPEND descriptor)."""
    line = json.dumps(to_jsonable(record), separators=(",", ":")) + "\n"
    # A link, FIFO, device or hard-linked file is refused (exit 2), before the fault runs.
    fd = append_log(path, mode=0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_audit(path: Path) -> list[dict[str, Any]]:
    """Every record of an audit log (tests and `drill` reports read it back); a line that
    is not a JSON object is an `InventoryError` naming the file and line."""
    if not path.exists():
        return []
    text = read_document(path, limit=_MAX_AUDIT_BYTES, what="JSON lines")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, path, line=number)
        if not isinstance(record, dict):
            msg = "expected a JSON object (one audit record a line)"
            raise InventoryError(msg, path=path, line=number)
        records.append(record)
    return records


def write_record(path: Path, data: Any) -> None:
    """Write a pending-revert record atomically (never half-written)."""
    write_atomic(path, json.dumps(to_jsonable(data), indent=2) + "\n", mode=0o600)
