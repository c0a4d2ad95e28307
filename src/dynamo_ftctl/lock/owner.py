"""The owner record of an flock lock file and its fencing token (with the token floor).

The lock file holds the owner data as JSON (engine id, pid, host, acquired-at
and the fencing token), written in place while the lock is held (a rename would
create a new inode and with it a second lock). Tokens come from the token floor
`P.floor` beside the lock file `P`; the rules for whose claim counts are in
`flock.py`'s docstring. This module issues tokens and reads and writes the
records; it never takes the lock itself (`flock.py` does, and calls it while held).

Tokens are a hybrid logical clock: the wall clock's milliseconds times 2**16 plus a
counter, and never below the floor (`next_token`), so a directory wiped of both files
still issues above every earlier token, as long as the wall clock has not gone back by
more than the time since the last one was issued.

Every file here is opened by `safefiles.open_regular`: never through a symbolic link,
never a FIFO, device, socket or directory, never written with a second hard link.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.lock.protocol import OwnerInfo
from dynamo_ftctl.lock.watch import FileIdentity, lock_file_gone
from dynamo_ftctl.safefiles import open_regular

__all__ = ["BACKEND", "COUNTER_BITS", "FLOOR_SUFFIX", "clock_token", "floor_knows",
           "floor_path", "read_owner", "reserve_token", "write_owner"]

BACKEND = "flock"
# Owner data is ~150 bytes of JSON; anything past this is not ours.
OWNER_MAX = 4096
# The token floor of lock file P is P + this suffix.
FLOOR_SUFFIX = ".floor"
# The floor's record is padded to this size (the longest is ~120 bytes).
FLOOR_RECORD = 128
# Fencing tokens stay within a signed 64-bit integer, what storage usually keeps.
_TOKEN_MAX = 2**63 - 1
# A token is wall-clock milliseconds << COUNTER_BITS, plus a counter for the tokens issued
# within one millisecond (a handoff takes far longer): 2**47 ms lasts until the year 6400.
COUNTER_BITS = 16
_log = logging.getLogger("ftctl.lock")
# Read once, not on the handoff (a pod's host name does not change under it).
_HOST = socket.gethostname()


def parse_owner(data: bytes) -> dict[str, Any]:
    try:
        doc = loads(data.decode("utf-8")) if data.strip() else {}
    except (UnicodeDecodeError, ValueError, RecursionError):  # 4 KiB of "[" is too deep
        return {}
    return doc if isinstance(doc, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def owner_from(doc: dict[str, Any], *, lock: str, live: bool) -> OwnerInfo:
    acquired = doc.get("acquired_at")
    host = doc.get("host")
    return OwnerInfo(
        lock=lock, backend=BACKEND, live=live,
        engine_id=_int_or_none(doc.get("engine_id")), pid=_int_or_none(doc.get("pid")),
        host=host if isinstance(host, str) else None,
        acquired_at=float(acquired) if isinstance(acquired, int | float) else None,
        token=_int_or_none(doc.get("token")),
    )


def floor_path(lock_path: Path) -> Path:
    """The token floor kept beside the lock file `lock_path`: `P.floor`, in the same
    directory (a lock file that is a symbolic link is refused, never followed)."""
    return lock_path.with_name(lock_path.name + FLOOR_SUFFIX)


def clock_token(wall_s: float) -> int:
    """The lowest token the wall clock allows at `wall_s` (seconds since the epoch):
    its milliseconds shifted above the counter bits."""
    return max(0, int(wall_s * 1000)) << COUNTER_BITS


@dataclass(frozen=True)
class _Floor:
    """The floor's record: the last token issued, for which lock file inode, and the
    high-water mark `high` (>= `token`): the highest token issued or reserved."""

    token: int
    locked: FileIdentity
    high: int


def _read_floor(data: bytes) -> _Floor | None:
    doc = parse_owner(data)
    # "token" is the high-water mark: an older ftctl, which knows only "token", then
    # issues above every reservation too. "issued" is absent in its records.
    high, dev, ino = (_int_or_none(doc.get(key)) for key in ("token", "dev", "ino"))
    if high is None or dev is None or ino is None or not 0 <= high <= _TOKEN_MAX:
        return None  # missing, empty or not ours: as if there were no floor
    issued = _int_or_none(doc.get("issued"))
    issued = high if issued is None or not 0 <= issued <= high else issued
    return _Floor(issued, FileIdentity(dev, ino), high)


def _floor_record(high: int, issued: int, locked: FileIdentity) -> bytes:
    """The floor's content, always FLOOR_RECORD bytes: an in-place rewrite never changes
    the file's size, and the high-water mark comes first, so a rewrite that keeps it keeps
    its bytes (a torn, unsynced write cannot lower it)."""
    # Formatted by hand: json.dumps costs several times more, on the hot path.
    record = b'{"token":%d,"issued":%d,"dev":%d,"ino":%d}' % (high, issued, locked.dev,
                                                               locked.ino)
    return record.ljust(FLOOR_RECORD - 1) + b"\n"


def _write_in_place(fd: int, payload: bytes) -> None:
    """Replace the file's content with `payload` (a single pwrite: the death of this
    process cannot tear it)."""
    os.pwrite(fd, payload, 0)
    if os.fstat(fd).st_size != len(payload):
        os.ftruncate(fd, len(payload))


def _open_floor(floor: Path) -> int:
    """The floor, created if missing and flocked: issuers take turns on it for microseconds."""
    while True:
        try:
            fd = open_regular(floor, os.O_CREAT | os.O_RDWR)  # not through a planted link
        except OSError as exc:
            msg = f"{floor}: cannot open the token floor: {exc.strerror}"
            raise InvalidInput(msg) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if lock_file_gone(floor, FileIdentity.of_fd(fd)) is None:
            return fd
        os.close(fd)  # replaced between open and flock: the new one is the floor


def _sync_directory(path: Path) -> None:
    """fsync `path`'s directory, so a file just created there survives a power loss."""
    with contextlib.suppress(OSError):  # some file systems refuse fsync on a directory
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _next_token(floor: _Floor | None, locked: FileIdentity, claimed: int, name: str) -> int:
    """The lowest token the records allow (one above the last issued): see `flock.py`'s
    docstring for whose word counts. The wall clock's floor is the caller's."""
    if floor is None:
        token = claimed + 1
    elif floor.locked == locked:
        token = max(floor.token, claimed) + 1
    else:
        token = floor.token + 1
        if claimed > floor.token:
            _log.warning("%s: the lock file was replaced and claims token %d, above the "
                         "floor's %d: ignored (not issued here)", name, claimed, floor.token)
    if token > _TOKEN_MAX:
        msg = f"{name}: the next fencing token would pass 2**63 - 1; the floor is corrupt"
        raise InvalidInput(msg)
    return token


def reserve_token(floor: Path, wall_s: float) -> int | None:
    """Reserve the next token durably (floor rewritten and fsynced) before blocking for the
    lock, so that the handoff itself needs no fsync: above the floor's high-water mark
    and at least `clock_token(wall_s)`. None when there is no floor yet (the lock file's
    own claim may then count: the grant issues with an fsync)."""
    try:
        if not floor.exists():
            return None
        floor_fd = _open_floor(floor)
    except (OSError, InvalidInput):
        return None  # the grant tries again and reports what is wrong
    try:
        record = _read_floor(os.pread(floor_fd, OWNER_MAX, 0))
        if record is None:
            return None
        reserved = max(record.high + 1, clock_token(wall_s))
        if reserved > _TOKEN_MAX:
            return None
        _write_in_place(floor_fd, _floor_record(reserved, record.token, record.locked))
        os.fsync(floor_fd)
    except OSError:
        return None
    finally:
        os.close(floor_fd)
    return reserved


def _issue(floor: Path, locked: FileIdentity, claimed: int, name: str, *,
           reserved: int | None, wall_s: float) -> int:
    """The next token, recorded in the floor: a still valid reservation (above every token
    issued, under the durable high-water mark) costs no fsync; otherwise a token above
    the high-water mark and at least `clock_token(wall_s)`, fsynced before it is
    returned."""
    floor_fd = _open_floor(floor)
    try:
        data = os.pread(floor_fd, OWNER_MAX, 0)
        record = _read_floor(data)
        token = _next_token(record, locked, claimed, name)
        if record is not None and reserved is not None and token <= reserved <= record.high:
            # The reservation's high-water mark is on disk already: a power loss now
            # cannot let a later token repeat or undercut this one.
            _write_in_place(floor_fd, _floor_record(record.high, reserved, locked))
            return reserved
        token = max(token, clock_token(wall_s), record.high + 1 if record else 0)
        if token > _TOKEN_MAX:
            msg = f"{name}: the next fencing token would pass 2**63 - 1; the floor is corrupt"
            raise InvalidInput(msg)
        _write_in_place(floor_fd, _floor_record(token, token, locked))
        os.fsync(floor_fd)
    finally:
        os.close(floor_fd)
    if not data:  # the floor was just created: make its name durable too
        _sync_directory(floor)
    return token


def write_owner(data_fd: int, floor: Path | None, name: str, *, locked: FileIdentity,
                 engine_id: int, pid: int, acquired_at: float,
                 reserved: int | None = None) -> int:
    """Issue the next token (floor first, durable), then write owner data in place; the token.

    Must be called while holding the lock on the inode `locked`. `data_fd` reads and
    writes the owner data (the locked descriptor unless that is write-only); `floor`
    None: no floor (the lock file's path is not known); `name` is the lock's, for messages;
    `acquired_at`: the wall clock now (it sets the token's lowest value, `clock_token`);
    `reserved`: what `reserve_token` gave before the wait, used when still valid.
    """
    claimed = _int_or_none(parse_owner(os.pread(data_fd, OWNER_MAX, 0)).get("token"))
    claimed = min(max(claimed or 0, 0), _TOKEN_MAX)
    if floor is None:
        token = max(_next_token(None, locked, claimed, name), clock_token(acquired_at))
    else:
        token = _issue(floor, locked, claimed, name, reserved=reserved, wall_s=acquired_at)
    _write_in_place(data_fd, json.dumps({
        "engine_id": engine_id, "pid": pid, "host": _HOST,
        "acquired_at": acquired_at, "token": token,
    }, separators=(",", ":")).encode() + b"\n")
    return token


def read_owner(path: Path) -> OwnerInfo | None:
    """Owner data of the lock file at `path`, probing whether its holder is alive.

    The probe opens a second open file description and asks for a shared lock
    without blocking: granted means nobody holds the lock (the data is stale),
    refused means a live holder. Reading under that shared lock also means no
    holder can be rewriting the data while it is read.
    """
    if not path.parent.is_dir():
        return None  # (open_regular would say "cannot write" of a missing directory)
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live = True
        else:
            live = False
        data = os.pread(fd, OWNER_MAX, 0)
        if not live:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    doc = parse_owner(data)
    if not doc and not live:
        return None
    return owner_from(doc, lock=str(path), live=live)


def floor_knows(floor: Path, locked: FileIdentity) -> bool:
    """True when the floor's last token was issued for the inode `locked`: the lock file
    is the one the last holder locked, not a new or replacing one (a holder of the old
    file may still run: see `bound.py`). False without a floor or a readable record."""
    try:
        fd = open_regular(floor, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        record = _read_floor(os.pread(fd, OWNER_MAX, 0))
    finally:
        os.close(fd)
    return record is not None and record.locked == locked
