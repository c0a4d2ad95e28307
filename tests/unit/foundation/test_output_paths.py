"""Output paths: ftctl writes regular files or new paths, and a failed write is one line."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_ftctl.cli._light import guarded
from dynamo_ftctl.errors import ExitCode, OutputRefused, WriteFailed
from dynamo_ftctl.output import check_output_dir, check_output_path, write_atomic

ROOT = Path(__file__).resolve().parents[3]
AS_ROOT = os.geteuid() == 0


@contextlib.contextmanager
def unix_socket(path: Path) -> Iterator[Path]:
    """A bound AF_UNIX socket at `path`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        yield path
    finally:
        sock.close()


def null_device(folder: Path) -> Path:
    """A character device like /dev/null, made in `folder`: a test that goes wrong can only
    replace this copy, never the system's."""
    if not AS_ROOT:
        pytest.skip("mknod of a device node needs root")
    path = folder / "null"
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def _kind(path: Path) -> int:
    return stat.S_IFMT(path.lstat().st_mode)


def _left_over(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("make", ["fifo", "socket", "directory", "device"])
def test_write_atomic_refuses_what_is_not_a_regular_file(tmp_path: Path, make: str) -> None:
    """A FIFO, socket, directory or device is refused (exit 2) and left as it was."""
    target = tmp_path / make
    with contextlib.ExitStack() as stack:
        if make == "fifo":
            os.mkfifo(target)
        elif make == "socket":
            stack.enter_context(unix_socket(target))
        elif make == "directory":
            target.mkdir()
        else:
            target = null_device(tmp_path)
        before = _kind(target)
        with pytest.raises(OutputRefused, match=r"^.*: is a .*; ftctl writes only") as caught:
            write_atomic(target, "data\n")
        assert caught.value.exit_code == ExitCode.USAGE
        assert _kind(target) == before
        assert _left_over(tmp_path) == []


def test_a_symbolic_link_out_of_its_directory_is_refused(tmp_path: Path) -> None:
    """A link to a file elsewhere is refused; the link and its target stay as they were."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "passwd"
    victim.write_text("root:x:0:0\n")
    out = tmp_path / "out"
    out.mkdir()
    link = out / "set.yaml"
    link.symlink_to(victim)
    with pytest.raises(OutputRefused, match=r"is a symbolic link to .*passwd, outside its dir"):
        write_atomic(link, "model: m\n")
    assert link.is_symlink()
    assert victim.read_text() == "root:x:0:0\n"
    relative = out / "rel.yaml"
    relative.symlink_to(Path("..") / "elsewhere" / "passwd")
    with pytest.raises(OutputRefused):
        write_atomic(relative, "model: m\n")


def test_a_symbolic_link_to_a_device_is_refused(tmp_path: Path) -> None:
    """A link beside a device node, to it, is refused as the device itself is."""
    device = null_device(tmp_path)
    link = tmp_path / "out.yaml"
    link.symlink_to(device.name)
    with pytest.raises(OutputRefused, match="is a character device"):
        write_atomic(link, "x\n")
    assert stat.S_ISCHR(device.lstat().st_mode)


def test_a_link_within_its_directory_writes_its_target(tmp_path: Path) -> None:
    """`current.yaml -> v3.yaml`: v3.yaml gets the data, current.yaml stays a link."""
    (tmp_path / "v3.yaml").write_text("old\n")
    link = tmp_path / "current.yaml"
    link.symlink_to("v3.yaml")
    write_atomic(link, "new\n")
    assert link.is_symlink()
    assert (tmp_path / "v3.yaml").read_text() == "new\n"
    dangling = tmp_path / "next.yaml"
    dangling.symlink_to("v4.yaml")
    write_atomic(dangling, "v4\n")
    assert (tmp_path / "v4.yaml").read_text() == "v4\n"
    loop = tmp_path / "loop.yaml"
    loop.symlink_to("loop.yaml")
    with pytest.raises(OutputRefused, match="symbolic link loop"):
        write_atomic(loop, "x\n")


def test_a_regular_file_is_replaced_whole(tmp_path: Path) -> None:
    """A regular file or a new path (parents made) is written, no temp file left."""
    path = tmp_path / "a" / "b" / "out.json"
    write_atomic(path, "1\n")
    write_atomic(path, b"2\n")
    assert path.read_text() == "2\n"
    assert _left_over(path.parent) == []
    assert check_output_path(path) == path


def test_a_file_in_the_way_of_the_folder_is_one_line(tmp_path: Path) -> None:
    """`--out file.txt/x.yaml`: WriteFailed (exit 1) naming the path, nothing made."""
    (tmp_path / "file.txt").write_text("keep\n")
    for path in (tmp_path / "file.txt" / "x.yaml", tmp_path / "file.txt" / "deeper" / "x.yaml"):
        with pytest.raises(WriteFailed, match=r"x\.yaml: cannot write: Not a directory$") as caught:
            write_atomic(path, "x\n")
        assert caught.value.exit_code == ExitCode.FAILED
    assert (tmp_path / "file.txt").read_text() == "keep\n"


def test_output_folders_are_directories_or_new(tmp_path: Path) -> None:
    """`load --out DIR`: a directory, a link to one or a new path; a file or FIFO is refused."""
    assert check_output_dir(tmp_path) == tmp_path
    assert check_output_dir(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "p")
    for name, kind in (("f", "a file"), ("p", "a FIFO")):
        with pytest.raises(OutputRefused, match=f"is {kind}; ftctl writes its files into"):
            check_output_dir(tmp_path / name)


@pytest.mark.skipif(AS_ROOT, reason="root may write into a read-only directory")
def test_permission_denied_is_one_line(tmp_path: Path) -> None:
    """A directory the user may not write: WriteFailed naming the path, no temp file."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(WriteFailed, match="Permission denied"):
            write_atomic(folder / "x.yaml", "x\n")
    finally:
        folder.chmod(0o700)


# ----------------------------------------------------------------- the CLI, for real


def ftctl(*argv: str, cwd: Path, fsize: int | None = None) -> subprocess.CompletedProcess[str]:
    """`ftctl argv` in a child; `fsize` caps the size of files it may write (EFBIG past it)."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails instead
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", *argv], capture_output=True, text=True,
        timeout=120, check=False, cwd=cwd, preexec_fn=limit,
        env={**os.environ, "NO_COLOR": "1", "FTCTL_INVENTORY": "", "FTCTL_NO_CACHE": "1"},
    )


RECORD = ("canary", "record", "--url", "http://127.0.0.1:9", "--model", "m",
          "--warmup-timeout", "0", "--out")
LOAD = ("load", "--url", "http://127.0.0.1:9", "--rate", "1", "--requests", "1", "--no-plot",
        "--out")


@pytest.mark.parametrize("make", ["fifo", "device", "outside-link", "directory"])
@pytest.mark.parametrize("command", [RECORD, LOAD], ids=["canary-record", "load"])
def test_a_bad_out_is_refused_before_the_work(
    tmp_path: Path, make: str, command: tuple[str, ...],
) -> None:
    """`canary record --out` / `load --out` at a FIFO, device or outside link: exit 2 and one
    line before any request (the worker would answer 3: refused), the node left as it was."""
    if make == "fifo":
        target = tmp_path / "fifo"
        os.mkfifo(target)
    elif make == "device":
        target = null_device(tmp_path)
    elif make == "outside-link":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "victim").write_text("keep\n")
        (tmp_path / "out").mkdir()
        target = tmp_path / "out" / ("summary.json" if command is LOAD else "set.yaml")
        target.symlink_to(tmp_path / "elsewhere" / "victim")
        if command is LOAD:
            target = target.parent
    else:
        target = tmp_path / "dir"
        target.mkdir()
        if command is LOAD:  # a directory is what load wants: put one where a file goes
            (target / "requests.csv").mkdir()
    before = _kind(target)
    proc = ftctl(*command, str(target), cwd=tmp_path)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {target}"), proc.stderr
    assert _kind(target) == before
    if make == "outside-link":
        assert (tmp_path / "elsewhere" / "victim").read_text() == "keep\n"


def test_load_out_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    """`load --out` under /proc (no one may create there): exit 1, one line naming it."""
    out = Path("/proc") / f"ftctl-test-{os.getpid()}"
    proc = ftctl(*LOAD, str(out), cwd=tmp_path)
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: {out}/summary.json: cannot create the directory {out}: "
        "No such file or directory"]


def test_load_out_that_fails_mid_write_keeps_the_old_report(tmp_path: Path) -> None:
    """A write that fails (file size cap: EFBIG, as a full disk would): exit 1, one line,
    the previous summary.json whole and no temporary file left."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("previous\n")
    proc = ftctl(*LOAD, str(out), cwd=tmp_path, fsize=64)
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    assert proc.stderr.splitlines() == [f"error: {out}/summary.json: cannot write: File too large"]
    assert (out / "summary.json").read_text() == "previous\n"
    assert _left_over(out) == []


def test_sim_refuses_a_device_pid_file_and_leaves_it(tmp_path: Path) -> None:
    """`sim serve --pid-file` at a device node: exit 2 before serving; the node is neither
    replaced by the pid nor unlinked at exit (as root, /dev/null would have gone)."""
    device = null_device(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "sim", "serve", "--port", "0",
         "--pid-file", str(device)],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: {device}: is a character device; ftctl writes only to a regular file or a "
        "new path"]
    assert stat.S_ISCHR(device.lstat().st_mode)


def test_an_untranslated_file_error_is_still_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's boundary: an OSError naming a file (a plot, a log) is one line, exit 1."""
    def fails() -> int:
        raise PermissionError(13, "Permission denied", "/srv/reports/timeline.png")

    assert guarded(fails, debug=False) == ExitCode.FAILED
    assert capsys.readouterr().err == "error: /srv/reports/timeline.png: Permission denied\n"
