"""Every file ftctl writes is opened here, and nowhere else (a test walks `src/` for that).

ftctl often runs as root in directories other pods may write, so a name there may have
been replaced by a link, a FIFO or a device between two runs. The rules, in one place:

- **The directory a file goes into is opened once**, with `O_NOFOLLOW`, and the file is
  made relative to that descriptor (`openat`, `renameat`): the directory as named must
  not be a symbolic link (`load --out dirlink`, `-o dirlink/x.yaml` are refused, exit 2).
  Leading components of a path the user typed are followed as the system resolves them
  (write `/run/x.pid`, not `/var/run/x.pid`, where /var/run is a link).
- **The file itself is never followed**, with one exception for a file the user named:
  a link to a file in its own directory (`current.yaml -> v3.yaml`) writes its target
  and keeps the link. A file ftctl names inside an output directory (`summary.json`) is
  never followed. A link elsewhere, a FIFO, a device, a socket or a directory is
  `OutputRefused` (exit 2), one line naming the path and what it is; a FIFO never blocks
  (opened `O_NONBLOCK`, refused before any write).
- **Whole files** (`write_atomic`) are written to a temporary name made with `O_EXCL`
  and renamed over the target inside the same directory descriptor: never half-written,
  and a hard link to another file is cut, not written through.
- **Files written in place** (`open_regular`: logs, lock files, process output) must be
  regular with one hard link; a new one is created with `O_EXCL`. Logs append with
  `O_APPEND` (`append_log`, `open_log`).
- **Names built from data** (model ids, worker names) go through `child_name`: one path
  component, or `InvalidInput` (exit 2). `file_name_for` turns a model id such as
  `Qwen/Qwen2.5` into one component (`Qwen--Qwen2.5`), as Hugging Face's cache does.
- **Devices ftctl must write** (`/dev/kmsg`) have their own opener, `open_device`, that
  requires a character device; `open_proc_self` writes the process's own /proc files.

What this module does not guard: a leading directory the user named being swapped by
someone who may write its parent (the user chose that path), and a file ftctl reads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from dynamo_ftctl.errors import InvalidInput, OutputRefused, WriteFailed

__all__ = [
    "append_log",
    "check_log",
    "check_output_dir",
    "check_output_path",
    "child_name",
    "file_name_for",
    "make_output_dir",
    "open_device",
    "open_log",
    "open_proc_self",
    "open_regular",
    "open_sink",
    "read_regular",
    "temp_log",
    "user_cache_dir",
    "write_atomic",
    "write_into",
]

_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}
_ONLY_REGULAR = "ftctl writes only to a regular file or a new path"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def user_cache_dir(name: str) -> Path | None:
    """`$XDG_CACHE_HOME/ftctl/<name>` (else `~/.cache/ftctl/<name>`): where ftctl keeps what
    it can make again (parsed YAML, compiled kernels); None when `$FTCTL_NO_CACHE` is set or
    there is no home to find."""
    if os.environ.get("FTCTL_NO_CACHE"):
        return None
    base = os.environ.get("XDG_CACHE_HOME")
    try:
        root = Path(base) if base else Path.home() / ".cache"
    except (RuntimeError, KeyError):  # no $HOME and no passwd entry: no cache
        return None
    return root / "ftctl" / name


def _kind(mode: int) -> str:
    return _NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")


def _failed(path: Path, exc: OSError) -> WriteFailed:
    return WriteFailed(path, f"cannot write: {exc.strerror or exc}")


# ------------------------------------------------------------------------- names


def child_name(name: str, *, what: str = "name") -> str:
    """`name` when it is one path component (not empty, no '/', not '.' or '..', no NUL);
    `InvalidInput` (exit 2) naming it otherwise. For names built from data."""
    if not name or name in {".", ".."} or "/" in name or "\0" in name:
        msg = (f"{what} {name!r} is not one file name (no '/', '..' or NUL): it would "
               "leave its directory")
        raise InvalidInput(msg)
    return name


def file_name_for(model: str, suffix: str = "") -> str:
    """A model id as one file name: each '/' becomes '--' (`Qwen/Qwen2.5` ->
    `Qwen--Qwen2.5`), a leading '.' becomes '_' (no hidden or '..' names); the result is
    `child_name`-checked (a NUL or an empty id is `InvalidInput`)."""
    name = model.replace("/", "--")
    if name.startswith("."):
        name = "_" + name[1:]
    return child_name(child_name(name, what="model id") + suffix, what="model id")


# ------------------------------------------------------------------- directories


def _make_dirs(folder: Path, *, named: Path) -> None:
    """Create `folder` and its parents for a write to `named` (the path the user gave)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where a directory should be, on the way to `folder`
        raise WriteFailed(named, f"cannot write: {folder} is not a directory") from None
    except NotADirectoryError:  # a file on the way, further up
        raise WriteFailed(named, "cannot write: Not a directory") from None
    except OSError as exc:
        reason = f"cannot create the directory {exc.filename or folder}: {exc.strerror or exc}"
        raise WriteFailed(named, reason) from None


def _open_dir(folder: Path, *, named: Path, create: bool) -> int:
    """A descriptor on `folder`, not followed if it is a link; `OutputRefused` for a link
    or a non-directory, `WriteFailed` when it cannot be made or opened."""
    if create:
        with contextlib.suppress(OSError):  # an error shows on the open below
            info = os.lstat(folder)
            if stat.S_ISLNK(info.st_mode):
                raise _linked_dir(folder, named)
        if not folder.exists():
            _make_dirs(folder, named=named)
    try:
        return os.open(folder, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in {errno.ELOOP, errno.ENOTDIR}:
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.lstat(folder).st_mode):
                    raise _linked_dir(folder, named) from None
            if exc.errno == errno.ENOTDIR:
                raise WriteFailed(named, "cannot write: Not a directory") from None
        raise _failed(named, exc) from None


def _linked_dir(folder: Path, named: Path) -> OutputRefused:
    if folder == named:
        return OutputRefused(named, "is a symbolic link; ftctl writes into a directory only "
                             "as named, not through a link (name its target)")
    return OutputRefused(named, f"{folder} is a symbolic link; ftctl writes into a directory "
                         "only as named, not through a link (name its target)")


def check_output_dir(path: Path) -> Path:
    """`path` when it can hold ftctl's output files: a directory (not a link to one) or a
    new path; `OutputRefused` (exit 2) otherwise. The files in it get `write_into`."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise _failed(path, exc) from None
    if stat.S_ISDIR(info.st_mode):
        return path
    if stat.S_ISLNK(info.st_mode):
        raise _linked_dir(path, path)
    kind = "a file" if stat.S_ISREG(info.st_mode) else _kind(info.st_mode)
    raise OutputRefused(path, f"is {kind}; ftctl writes its files into a directory or a new path")


def make_output_dir(path: Path) -> Path:
    """`check_output_dir`, then create `path` with its parents; `WriteFailed` (exit 1)
    naming it when the system refuses."""
    check_output_dir(path)
    _make_dirs(path, named=path)
    check_output_dir(path)  # made by someone else in between: as refused as before
    return path


@contextlib.contextmanager
def _parent(path: Path, *, create: bool) -> Iterator[int]:
    folder = path.parent
    fd = _open_dir(folder, named=path, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


# ----------------------------------------------------------- the file in its folder


def _entry(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _resolve(dir_fd: int, path: Path, *, follow_link: bool) -> str:
    """The name in `dir_fd` that a write to `path` replaces; `OutputRefused` when it is
    not a regular file or a new name (see the module's rules for links)."""
    name = path.name
    if name in {"", ".", ".."}:
        raise OutputRefused(path, "is not a file name; " + _ONLY_REGULAR)
    info = _entry(dir_fd, name)
    if info is None:
        return name
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(name, dir_fd=dir_fd)
        if not follow_link:
            raise OutputRefused(path, f"is a symbolic link (to {target}); ftctl does not "
                                "write through a link it did not name")
        if "/" in target or target in {".", ".."}:
            where = os.path.normpath(path.parent / target)
            raise OutputRefused(path, f"is a symbolic link to {where}, outside its "
                                "directory; name the file itself")
        if target == name:
            raise OutputRefused(path, "is a symbolic link loop; name the file itself")
        linked = _entry(dir_fd, target)
        if linked is None:
            return target
        if stat.S_ISLNK(linked.st_mode):
            raise OutputRefused(path, "is a symbolic link to a symbolic link (a symbolic "
                                "link loop or chain); name the file itself")
        info, name = linked, target
    if stat.S_ISREG(info.st_mode):
        return name
    raise OutputRefused(path, f"is {_kind(info.st_mode)}; {_ONLY_REGULAR}")


def check_output_path(path: Path, *, follow_link: bool = True) -> Path:
    """The file that writing to `path` replaces (a link within its directory resolved);
    `OutputRefused` (exit 2) when it is not a regular file or a new path, before the work.

    The write checks again (`write_atomic`); this is the early, friendly refusal.
    """
    try:
        fd = _open_dir(path.parent, named=path, create=False)
    except WriteFailed:
        return path  # not there yet (made at the write) or unwritable: said at the write
    try:
        return path.with_name(_resolve(fd, path, follow_link=follow_link))
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str | Sequence[Any], *, mode: int = 0o644,
                 follow_link: bool = True, sync: bool = True) -> None:
    """Write `data` (or the concatenation of its buffers) to `path` through a temporary
    file and a rename in the same directory descriptor: never half-written, never through
    a link the module's rules refuse.

    A device, FIFO, socket, directory or refused link is `OutputRefused` (exit 2); a
    failed write is `WriteFailed` naming the path (exit 1) and leaves the previous file,
    if any, as it was, with no temporary file. `follow_link=False` for names ftctl
    chose itself (files in an output directory). `sync=False` skips the fsync: the file
    is still whole or absent after a crash of the writer, not of the host (a cache).
    """
    if isinstance(data, str):
        parts: Sequence[Any] = [data.encode()]
    elif isinstance(data, bytes | bytearray | memoryview):
        parts = [data]
    else:
        parts = data
    with _parent(path, create=True) as dir_fd:
        name = _resolve(dir_fd, path, follow_link=follow_link)
        tmp = f".{name}.{os.urandom(4).hex()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
        except OSError as exc:
            raise _failed(path, exc) from None
        try:
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _resolve(dir_fd, path, follow_link=follow_link)  # swapped meanwhile: refused
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            _discard(dir_fd, tmp)
            raise _failed(path, exc) from None
        except BaseException:
            _discard(dir_fd, tmp)
            raise


def write_into(directory: Path, name: str, data: bytes | str, *, mode: int = 0o644) -> Path:
    """`write_atomic` of `directory/name`, where ftctl chose `name` (or built it from data:
    `child_name`-checked) and `directory` is an output directory: a link in either place
    is refused. Returns the path written."""
    path = directory / child_name(name)
    write_atomic(path, data, mode=mode, follow_link=False)
    return path


def _discard(dir_fd: int, tmp: str) -> None:
    """Remove a temporary file after a failed write (what removal itself fails on is moot)."""
    with contextlib.suppress(OSError):
        os.unlink(tmp, dir_fd=dir_fd)


# ----------------------------------------------------------------- files in place


# Looks at a name that others keep creating and removing (a lock file replaced under its
# contenders) before `open_regular` gives up: each attempt sees it present or absent and
# opens it that way, and only a removal or creation in between sends it round again.
_OPEN_ATTEMPTS = 100


def open_regular(path: Path | str, flags: int, mode: int = 0o644, *,
                 dir_fd: int | None = None) -> int:
    """`os.open` of a regular file, never through a link, never blocking on a FIFO.

    Adds `O_NOFOLLOW | O_CLOEXEC`; with `O_CREAT` a new file is made with `O_EXCL` and an
    existing one opened as it is; `O_TRUNC` is applied only after the checks. A link,
    FIFO, device, socket or directory is `OutputRefused` (exit 2) naming `path` and
    what it is; a file opened for writing must have one hard link (another name would
    be written through). Without `dir_fd` the file's directory is opened as
    `write_atomic` opens it (not a link; made when `O_CREAT`). Returns a blocking fd.
    """
    path = Path(path)
    if dir_fd is None:
        with _parent(path, create=bool(flags & os.O_CREAT)) as parent_fd:
            return open_regular(path, flags, mode, dir_fd=parent_fd)
    name = path.name
    writing = bool(flags & _WRITE_FLAGS)
    base = (flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | os.O_NOFOLLOW | os.O_CLOEXEC
    base |= os.O_NONBLOCK
    for _ in range(_OPEN_ATTEMPTS):
        before = _entry(dir_fd, name)
        if before is not None and not stat.S_ISREG(before.st_mode):
            raise OutputRefused(path, f"is {_kind(before.st_mode)}; {_ONLY_REGULAR}")
        try:
            if flags & os.O_CREAT and before is None:
                try:
                    fd = os.open(name, base | os.O_CREAT | os.O_EXCL, mode, dir_fd=dir_fd)
                except FileExistsError:
                    if flags & os.O_EXCL:
                        raise
                    continue  # made meanwhile: look again
            else:
                try:
                    fd = os.open(name, base, mode, dir_fd=dir_fd)
                except FileNotFoundError:
                    if flags & os.O_CREAT:
                        continue  # removed meanwhile (a lock file others replace): again
                    raise
        except OSError as exc:
            if exc.errno in {errno.ELOOP, errno.ENXIO, errno.EISDIR}:
                after = _entry(dir_fd, name)
                if after is not None:
                    raise OutputRefused(path, f"is {_kind(after.st_mode)}; "
                                        f"{_ONLY_REGULAR}") from None
            if isinstance(exc, FileNotFoundError | FileExistsError):
                raise
            raise _failed(path, exc) from None
        break
    else:
        raise _failed(path, OSError(errno.EAGAIN, f"it was made and removed {_OPEN_ATTEMPTS} "
                                    "times while it was being opened"))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OutputRefused(path, f"is {_kind(info.st_mode)}; {_ONLY_REGULAR}")
        if writing and info.st_nlink > 1:
            raise OutputRefused(path, f"has {info.st_nlink} hard links; ftctl writes in "
                                "place only to a file with one")
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path | str, limit: int) -> bytes:
    """`path`'s bytes, read as a regular file of one name (`open_regular`: no link
    followed, no FIFO, device or socket), `InvalidInput` naming it when it holds more
    than `limit` bytes; `FileNotFoundError` when there is none."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        msg = f"{path}: over {limit} bytes"
        raise InvalidInput(msg)
    return data


def check_log(path: Path | str) -> Path:
    """`path` when `append_log` would take it (a regular file with one link, or a new
    path); `OutputRefused` (exit 2) otherwise, before the work that ends in a log line."""
    path = Path(path)
    try:
        fd = _open_dir(path.parent, named=path, create=False)
    except WriteFailed:
        return path  # not there yet (made at the write) or unwritable: said at the write
    try:
        info = _entry(fd, path.name)
    finally:
        os.close(fd)
    if info is None:
        return path
    if not stat.S_ISREG(info.st_mode):
        raise OutputRefused(path, f"is {_kind(info.st_mode)}; {_ONLY_REGULAR}")
    if info.st_nlink > 1:
        raise OutputRefused(path, f"has {info.st_nlink} hard links; ftctl writes in place "
                            "only to a file with one")
    return path


def append_log(path: Path | str, *, mode: int = 0o644) -> int:
    """An `O_APPEND` descriptor on the log at `path` (created when new), by `open_regular`'s
    rules: a link, FIFO, device or hard-linked file is `OutputRefused` (exit 2)."""
    return open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)


def open_log(path: Path | str, *, mode: int = 0o644) -> IO[str]:
    """`append_log` as a line-buffered UTF-8 text file (one line, one write)."""
    return os.fdopen(append_log(path, mode=mode), "a", buffering=1, encoding="utf-8")


def open_sink(path: Path, *, append: bool) -> IO[bytes]:
    """A process's output file: appended to, or emptied first (`append=False`), by
    `open_regular`'s rules."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    return os.fdopen(open_regular(path, flags), "ab" if append else "wb")


def temp_log(prefix: str, suffix: str = ".log") -> Path:
    """A new, empty file in the system's temporary directory (`mkstemp`: `O_EXCL`, mode
    0600, a random name), for a log nobody named."""
    import tempfile  # only here: ftctl lock imports this module on its fast path

    handle, raw = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(handle)
    return Path(raw)


# ------------------------------------------------------------ devices and /proc


def open_device(path: Path | str, *, or_log: bool = False) -> int:
    """A write-only, appending descriptor on the character device at `path` (`/dev/kmsg`).

    Anything else is `OutputRefused` (exit 2), except, with `or_log`, a regular file or
    a new path, opened as `append_log` (tests stand a file in for the kernel log). A
    link to the device is followed only when it is a device the link names.
    """
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        info = None
    if info is not None and stat.S_ISCHR(info.st_mode):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOCTTY)
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputRefused(path, "is not a character device")
        return fd
    if not or_log:
        kind = "a new path" if info is None else _kind(info.st_mode)
        raise OutputRefused(path, f"is {kind}; ftctl writes here only to a character device")
    return append_log(path)


def reopen_rw(fd: int) -> int:
    """A second, read-write description of a file this process holds open as `fd` (a
    shell's `exec 9>P` lock descriptor is write-only): through `/proc/self/fd`, which
    names this process's own descriptor, so no link or FIFO can be planted there."""
    return os.open(f"/proc/self/fd/{int(fd)}", os.O_RDWR | os.O_CLOEXEC)


def open_proc_self(name: str) -> int:
    """A write-only descriptor on `/proc/self/<name>` (`comm`): the process's own file in
    procfs, which no other user can plant a link or FIFO at."""
    return os.open(f"/proc/self/{child_name(name)}", os.O_WRONLY | os.O_CLOEXEC)
