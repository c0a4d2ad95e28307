"""inotify(7) through ctypes: being told at once that a lock file was unlinked or replaced.

Only the lock watcher process (`watch.watcher_main`) loads this module, before it is
armed, so ctypes (~10 ms of CPU) is paid off the handoff and never by `ftctl lock
acquire` itself. The events only wake the watcher: what counts is still
`watch.lock_file_gone` (lstat of the path against the locked inode), so a lost or
spurious event costs a stat, never a wrong verdict, and the poll at the watch interval
stays as the floor (network file systems report nothing of other nodes' changes).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable
from pathlib import Path

__all__ = ["InodeEvents"]

# <sys/inotify.h>
_IN_ATTRIB = 0x4  # link count changes: an unlink (or a rename over it) of a file still open
_IN_MOVED_FROM, _IN_MOVED_TO = 0x40, 0x80
_IN_CREATE, _IN_DELETE = 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF = 0x400, 0x800
_IN_Q_OVERFLOW = 0x4000  # the queue overflowed: events were lost
_IN_ONLYDIR, _IN_DONT_FOLLOW = 0x01000000, 0x02000000
# The inode itself: unlinked, renamed away, freed.
_FILE_MASK = _IN_ATTRIB | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_DONT_FOLLOW
# Its directory: a name created, moved in or out, deleted (a new file or link at the path).
_DIR_MASK = _IN_CREATE | _IN_MOVED_TO | _IN_MOVED_FROM | _IN_DELETE | _IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class InodeEvents:
    """One inotify instance watching a lock file's inode and its name in its directory.

    `fd` is readable when something happened that may concern the lock file; `drain`
    empties it and says whether it did. `for_directory` returns None where inotify is missing
    (no libc symbol, ENOSYS, too many instances): the caller polls instead.
    """

    def __init__(self, fd: int, add_watch: Callable[[int, bytes, int], int]) -> None:
        self.fd = fd
        self._add_watch = add_watch
        self._name = b""

    @classmethod
    def for_directory(cls, directory: Path) -> InodeEvents | None:
        """An instance already watching `directory` for names coming and going."""
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init1, add_watch = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError):
            return None
        add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        fd = init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            return None
        events = cls(fd, add_watch)
        if not events._watch(directory, _DIR_MASK):
            events.close()
            return None
        return events

    def _watch(self, path: Path, mask: int) -> bool:
        return int(self._add_watch(self.fd, os.fsencode(path), mask)) >= 0

    def watch_file(self, path: Path) -> bool:
        """Watch the inode at `path` (not following a link): unlinked, renamed, freed.
        The caller checks afterwards that `path` is still the inode it locked."""
        self._name = os.fsencode(path.name)
        return self._watch(path, _FILE_MASK)

    def drain(self) -> bool:
        """Read every pending event; True when one may concern the lock file (an event of
        the inode itself, or of its name in the directory)."""
        relevant = False
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return relevant
            if not data:
                return relevant
            offset = 0
            while offset + _EVENT.size <= len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                # Events of the file carry no name; those of the directory carry one.
                relevant = (relevant or not name or name == self._name
                            or bool(mask & _IN_Q_OVERFLOW))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
