"""The kernel-log Xid watcher: parse `NVRM: Xid` lines from kmsg, journal, a file or stdin.

Line formats handled (all seen in the wild; the driver has changed them over
the years):

    NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double ...
    NVRM: Xid (PCI:0000:65:00): 119, pid='N/A', Timeout waiting for RPC from GSP ...
    NVRM: Xid (0000:01:00): 31, Ch 0000000b, engmask 00000120, intr 10000000
    NVRM: Xid (PCI:3b:00): 79, GPU has fallen off the bus.          (no PCI domain)
    NVRM: NVRM: Xid (PCI:0000:3b:00.0): 94, pid=77, Contained: ...  (doubled prefix)

with any prefix before them: dmesg `[  123.456]`, syslog/journal
`Oct 15 12:40:10 host kernel:`, or /dev/kmsg's `6,1234,5678,-;`.

Speed: most kernel-log lines are not Xids, so a plain substring test
(`"Xid" in line`) runs before any regular expression; the parser does well
over a million lines per second (benchmarks/xid.py). It never raises: a line
that mentions an NVRM Xid but does not parse is counted as malformed and
skipped.
"""

from __future__ import annotations

import errno
import io
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dynamo_ftctl.clock import Clock
from dynamo_ftctl.errors import InvalidInput, Unreachable
from dynamo_ftctl.gpu.events import GpuEvent, WorkerMap, xid_event
from dynamo_ftctl.gpu.nvml import NvmlBackend, normalize_pci_bus_id
from dynamo_ftctl.process import DEVNULL, PIPE, SPAWNER

__all__ = [
    "KmsgParser",
    "KmsgWatcher",
    "XidLine",
    "file_lines",
    "follow_file",
    "journal_lines",
    "kmsg_lines",
    "parse_pci_map",
    "parse_xid_line",
    "pci_map_from_nvml",
    "pci_map_from_procfs",
    "source_lines",
]

_XID = re.compile(
    r"NVRM: (?:NVRM: )*Xid \((?:PCI:)?"
    r"(?P<pci>[0-9A-Fa-f]{1,8}(?::[0-9A-Fa-f]{1,2}){1,2}(?:\.[0-7])?)\):? ?"
    r"(?P<xid>[0-9]{1,5})(?![0-9]),? ?(?P<rest>.*)"
)


@dataclass(frozen=True)
class XidLine:
    """What one kernel-log Xid line says."""

    xid: int
    pci_bus_id: str
    pid: int | None
    process: str | None
    message: str
    raw: str


def _split_rest(rest: str) -> tuple[int | None, str | None, str]:
    """`pid=1234, name=python3, text` → (1234, "python3", "text"); every part optional."""
    pid: int | None = None
    process: str | None = None
    if rest.startswith("pid="):
        pid_text, _, rest = rest[4:].partition(",")
        pid_text = pid_text.strip().strip("'\"")
        if pid_text.isascii() and pid_text.isdigit():
            pid = int(pid_text)
        rest = rest.lstrip()
        if rest.startswith("name="):
            process, _, rest = rest[5:].partition(",")
            process = process.strip() or None
            rest = rest.lstrip()
    return pid, process, rest.strip()


def _from_match(match: re.Match[str], line: str) -> XidLine:
    pid, process, message = _split_rest(match.group("rest"))
    pci = match.group("pci")
    return XidLine(
        xid=int(match.group("xid")),
        pci_bus_id=normalize_pci_bus_id(pci) or pci.lower(),
        pid=pid, process=process, message=message, raw=line.rstrip("\r\n"),
    )


def parse_xid_line(line: str) -> XidLine | None:
    """The Xid a line reports, or None for any other (or malformed) line. Never raises."""
    if "Xid" not in line:
        return None
    match = _XID.search(line)
    return None if match is None else _from_match(match, line)


class KmsgParser:
    """A line parser that keeps counts: lines read, Xid lines, malformed lines."""

    def __init__(self) -> None:
        self.lines = 0
        self.xids = 0
        self.malformed = 0

    def parse_lines(self, lines: Iterable[str]) -> Iterator[XidLine]:
        """The Xid lines among `lines`, in order; counts are updated as it goes."""
        search = _XID.search
        seen = 0
        try:
            for line in lines:
                seen += 1
                # Cheap prefilter first: ~99% of kernel-log lines never reach the regex.
                if "Xid" not in line:
                    continue
                match = search(line)
                if match is None:
                    if "NVRM" in line and "SXid" not in line:
                        self.malformed += 1
                    continue
                self.xids += 1
                yield _from_match(match, line)
        finally:
            self.lines += seen


# -- PCI bus id → GPU index --------------------------------------------------------


def pci_map_from_nvml(nvml: NvmlBackend) -> dict[str, int]:
    """Bus id → index as NVML numbers the GPUs (what nvidia-smi shows)."""
    found: dict[str, int] = {}
    for index in range(nvml.device_count()):
        bus = normalize_pci_bus_id(nvml.snapshot(index).pci_bus_id)
        if bus is not None:
            found[bus] = index
    return found


def pci_map_from_procfs(root: Path = Path("/proc/driver/nvidia/gpus")) -> dict[str, int]:
    """Bus id → device minor number from the driver's procfs (no NVML needed).

    The minor number (/dev/nvidiaN) equals the NVML index on most hosts but
    not on all; NVML is preferred when it is available.
    """
    found: dict[str, int] = {}
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return found
    for entry in entries:
        bus = normalize_pci_bus_id(entry.name)
        if bus is None:
            continue
        try:
            text = (entry / "information").read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Device Minor" and value.strip().isdigit():
                found[bus] = int(value.strip())
    return found


def parse_pci_map(spec: str) -> dict[str, int]:
    """`0000:3b:00=0,0000:86:00=1` → {bus id: index}; `InvalidInput` names a bad item."""
    found: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        bus_text, sep, index_text = item.rpartition("=")
        bus = normalize_pci_bus_id(bus_text) if sep else None
        if bus is None or not index_text.strip().isdigit():
            msg = f"--pci-map: {item!r} is not BUS_ID=INDEX (e.g. 0000:3b:00=0)"
            raise InvalidInput(msg)
        found[bus] = int(index_text)
    return found


# -- sources -------------------------------------------------------------------------


def _open(path: Path, *, binary: bool) -> IO[Any]:
    try:
        if binary:
            return path.open("rb")
        return path.open(encoding="utf-8", errors="replace")
    except OSError as exc:
        msg = f"cannot read {path}: {exc.strerror or exc}"
        raise InvalidInput(msg) from exc


def file_lines(path: Path) -> Iterator[str]:
    """Every line of a file, read once to its end (text mode: the fast path)."""
    with _open(path, binary=False) as handle:
        yield from handle


def follow_file(
    path: Path, *, clock: Clock, poll_s: float = 0.01, follow: bool = True,
    stop: Callable[[], bool] = lambda: False,
) -> Iterator[str]:
    """Lines of `path` to its end, then (with `follow`) lines as they are appended.

    Like `tail -F`: a partial last line waits for its newline, and a file that
    is truncated or replaced (log rotation) is reopened from its start.
    `stop()` is checked whenever the reader is idle at the end of the file.
    """
    if not follow:
        yield from file_lines(path)
        return
    handle = _open(path, binary=True)
    try:
        inode = os.fstat(handle.fileno()).st_ino
        pending = b""
        while True:
            chunk = handle.readline()
            if chunk:
                if chunk.endswith(b"\n"):
                    yield (pending + chunk).decode("utf-8", "replace")
                    pending = b""
                else:
                    pending += chunk
                continue
            if stop():
                return
            try:
                current = path.stat()
            except FileNotFoundError:
                current = None
            if current is not None and (
                current.st_ino != inode or current.st_size < handle.tell()
            ):
                handle.close()
                handle = _open(path, binary=True)
                inode = os.fstat(handle.fileno()).st_ino
                pending = b""
                continue
            clock.sleep(poll_s)
    finally:
        handle.close()


def kmsg_lines(*, follow: bool, path: Path = Path("/dev/kmsg")) -> Iterator[str]:
    """Messages of the kernel ring buffer (/dev/kmsg records, prefix stripped)."""
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow else os.O_NONBLOCK))
    except PermissionError as exc:
        msg = f"cannot read {path}: permission denied (run as root, or use --source journal)"
        raise Unreachable(msg) from exc
    except OSError as exc:
        msg = f"cannot read {path}: {exc.strerror or exc}"
        raise Unreachable(msg) from exc
    try:
        while True:
            try:
                record = os.read(fd, 16384)
            except BlockingIOError:
                return  # the end of the buffer, without --follow
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # the record was overwritten while we read: skip it
                raise
            if not record:
                return
            _, _, message = record.partition(b";")
            yield message.split(b"\n", 1)[0].decode("utf-8", "replace")
    finally:
        os.close(fd)


def journal_lines(*, follow: bool) -> Iterator[str]:
    """Kernel messages of this boot from `journalctl -k`."""
    argv = ["journalctl", "-k", "-o", "short-iso", "--no-pager"]
    if follow:
        argv += ["-f", "-n", "all"]
    try:
        child = SPAWNER.spawn(argv, stdout=PIPE, stderr=DEVNULL)
    except OSError as exc:
        msg = f"cannot run journalctl: {exc.strerror or exc}"
        raise Unreachable(msg) from exc
    assert child.stdout is not None
    # Text as Popen(text=True) reads it: the locale's encoding, universal newlines.
    lines = io.TextIOWrapper(child.stdout, errors="replace")
    try:
        yield from lines
    finally:
        child.stop(5.0)
        lines.close()


def source_lines(
    source: str, *, follow: bool, clock: Clock, poll_s: float = 0.01,
    stop: Callable[[], bool] = lambda: False,
) -> Iterator[str]:
    """Lines from `--source`: `kmsg`, `journal`, `-` (stdin) or a file path."""
    if source == "kmsg":
        return kmsg_lines(follow=follow)
    if source == "journal":
        return journal_lines(follow=follow)
    if source == "-":
        return iter(sys.stdin)
    if not follow:
        return file_lines(Path(source))
    return follow_file(Path(source), clock=clock, poll_s=poll_s, stop=stop)


# -- the watcher -------------------------------------------------------------------------


class KmsgWatcher:
    """Kernel-log lines in, `GpuEvent`s out (the same records as `gpu watch`)."""

    def __init__(
        self, *, node: str, clock: Clock, pci_map: Mapping[str, int] | None = None,
        workers: WorkerMap | None = None,
    ) -> None:
        self.parser = KmsgParser()
        self._node = node
        self._clock = clock
        self._pci = dict(pci_map or {})
        self._workers = workers or WorkerMap()

    def events(self, lines: Iterable[str]) -> Iterator[GpuEvent]:
        """One event per Xid line, with GPU index and affected workers resolved."""
        for found in self.parser.parse_lines(lines):
            details: dict[str, object] = {"raw": found.raw}
            if found.pid is not None:
                details["pid"] = found.pid
            if found.process is not None:
                details["process"] = found.process
            yield xid_event(
                xid=found.xid, ts=self._clock.wall(), source="kmsg", node=self._node,
                gpu=self._pci.get(found.pci_bus_id), pci_bus_id=found.pci_bus_id,
                message=found.message, workers=self._workers, details=details,
            )
