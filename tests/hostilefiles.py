"""The hostile-file matrix: every CLI option that writes a file, against every planted kind.

`run_matrix()` runs `ftctl` in a child process (with a timeout: a FIFO must not hang it)
for each option that takes an output path, a report directory or a log path, after
planting one hostile kind where it writes: a symbolic link to a file elsewhere, a link
to a directory (`-o dirlink/x.yaml`, `--out dirlink`), a dangling link, a FIFO, a
character device (a private copy of /dev/null), a bound unix socket, a hard link to a
file elsewhere, and a path built from data that would leave its directory. Each row
says what was expected and what was seen; `ok` when they agree. The unit test
(tests/integration/safefiles/test_hostile_matrix.py) asserts every row; `make chaos`
prints them as a table. Runs best as root (device nodes need it; as another user those
rows are skipped, and say so).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60.0
KEEP = "keep: the victim's own content\n"
KINDS = ("symlink-file", "symlink-dir", "dangling", "fifo", "chardev", "socket", "hardlink")


@dataclass(frozen=True)
class Row:
    """One option against one hostile kind."""

    option: str
    kind: str
    expected: str
    observed: str
    ok: bool


@dataclass(frozen=True)
class Option:
    """A CLI option that writes: `shape` is file, dir or log; `argv(path, case)` builds
    the command line (an inventory in `case` when it needs one)."""

    name: str
    shape: str
    argv: Callable[[Path, Path], list[str]]
    first_file: str = "x.yaml"  # the file a dir option writes first (planted there)
    serves: bool = False  # runs until stopped once its file is accepted


def _inventory(case: Path, extra: str = "", worker: str = "", model: str = "m") -> Path:
    path = case / "inventory.yaml"
    path.write_text(f"cluster: t\nworkers:\n  - {{name: w1, url: 'http://127.0.0.1:9', "
                    f"model: {model}{worker}}}\n{extra}")
    return path


_WORKERS: dict[Path, subprocess.Popen[bytes]] = {}  # the `sleep` that plays inject's worker


def _inject(path: Path, case: Path) -> list[str]:
    # The fault: an Xid line into a stand-in kernel log, then SIGKILL of a sleeping child
    # that plays the worker; a refused audit log must stop it before either happens.
    victim = subprocess.Popen(["sleep", "120"], start_new_session=True)
    _WORKERS[case] = victim
    inv = _inventory(case, worker=(
        f", faults: [xid48], process: {{pid: {victim.pid}}}, "
        f"inject: {{injectors: [kmsg, signal], kmsg_path: '{case / 'kmsg.log'}'}}"))
    return ["-i", str(inv), "inject", "xid48", "--worker", "w1", "--yes", "--audit-log",
            str(path), "--state-dir", str(case / "state")]


def _daemon(path: Path, case: Path) -> list[str]:
    inv = _inventory(case, extra=f"canary: {{transition_log: '{path}', listen: '127.0.0.1:0',"
                     f" set: '{ROOT / 'canaries' / 'ftctl-sim-tiny.yaml'}'}}\n", model="ftctl-sim-tiny")
    return ["-i", str(inv), "canary", "--watch", "--no-state"]


OPTIONS = (
    Option("canary record --out", "file", lambda p, c: [
        "canary", "record", "--url", "http://127.0.0.1:9", "--model", "m",
        "--warmup-timeout", "0", "--out", str(p)]),
    Option("migrate calibrate --output", "file", lambda p, c: [
        "-i", str(_inventory(c)), "migrate", "calibrate", "--worker", "w1", "--output", str(p)]),
    Option("canary --state-file", "file", lambda p, c: [
        "canary", "--url", "http://127.0.0.1:9", "--set",
        str(ROOT / "canaries" / "ftctl-sim-tiny.yaml"), "--state-file", str(p)]),
    Option("sim serve --pid-file", "file", lambda p, c: [
        "sim", "serve", "--port", "0", "--pid-file", str(p)], serves=True),
    Option("load --out", "dir", lambda p, c: [
        "load", "--url", "http://127.0.0.1:9", "--rate", "1", "--requests", "1", "--no-plot",
        "--out", str(p)], first_file="summary.json"),
    Option("drill --out", "dir", lambda p, c: [
        "drill", str(ROOT / "drills" / "hang.yaml"), "--no-plot", "--out", str(p)],
        first_file="report.json"),
    Option("inject --audit-log", "log", _inject),
    Option("canary.transition_log", "log", _daemon),
)


# ------------------------------------------------------------------ planting


@contextlib.contextmanager
def _plant(kind: str, at: Path, victim_file: Path, victim_dir: Path) -> Iterator[None]:
    """Put `kind` at `at`; yields while it stands (a socket is closed after)."""
    with contextlib.ExitStack() as stack:
        if kind == "symlink-file":
            at.symlink_to(victim_file)
        elif kind == "symlink-dir":
            at.symlink_to(victim_dir)
        elif kind == "dangling":
            at.symlink_to(victim_dir / "created-through-link")
        elif kind == "fifo":
            os.mkfifo(at)
        elif kind == "chardev":
            os.mknod(at, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        elif kind == "socket":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stack.callback(sock.close)
            sock.bind(str(at))
        elif kind == "hardlink":
            os.link(victim_file, at)
        yield


def _ftctl(argv: list[str], cwd: Path) -> tuple[int | None, str]:
    """Exit status (None: it hung past the timeout and was killed) and stderr."""
    env = {**os.environ, "NO_COLOR": "1", "FTCTL_INVENTORY": "", "FTCTL_NO_CACHE": "1",
           "XDG_STATE_HOME": str(cwd / "xdg")}
    proc = subprocess.Popen([sys.executable, "-m", "dynamo_ftctl", *argv], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err
    return proc.returncode, err


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: its kind and, for a file, its content."""
    seen: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        rel = path.relative_to(folder).as_posix()
        seen[rel] = (path.read_text(errors="replace") if stat.S_ISREG(info.st_mode)
                     else stat.filemode(info.st_mode)[0])
    return seen


def _case(option: Option, kind: str, base: Path) -> Row:
    case = Path(tempfile.mkdtemp(prefix="case-", dir=base))
    victim_dir = case / "victim"
    victim_dir.mkdir()
    victim_file = victim_dir / ("passwd" if option.shape != "dir" else option.first_file)
    victim_file.write_text(KEEP)
    (victim_dir / option.first_file).write_text(KEEP)
    out = case / "out"
    out.mkdir()
    whole_file = option.shape in {"file", "dir"}
    expected = "exit 2, one line naming it, victim unchanged"
    if kind == "hardlink" and whole_file:
        expected = "victim unchanged (the rename cuts the link)"
    if option.shape == "dir":
        target = out  # what the user names
        planted = out if kind in {"symlink-dir", "chardev"} else out / option.first_file
        if planted == out:
            out.rmdir()
    elif kind == "symlink-dir":
        planted = case / "dirlink"  # `-o dirlink/x.yaml`
        target = planted / option.first_file
    else:
        target = planted = out / "target.log"
    if kind == "chardev" and os.geteuid() != 0:
        return Row(option.name, kind, expected, "skipped: mknod needs root", ok=True)
    if kind == "hardlink" and whole_file and option.serves:
        # Accepted, so it serves until stopped; the rename that cuts the link is
        # write_atomic's, shown by the other whole-file rows and the unit tests.
        return Row(option.name, kind, expected, "not run: serves once accepted", ok=True)
    before = _snapshot(victim_dir)
    with _plant(kind, planted, victim_file, victim_dir):
        code, err = _ftctl(option.argv(target, case), cwd=case)
    _reap(case)
    after = _snapshot(victim_dir)
    lines = err.strip().splitlines()
    leftovers = [p.name for p in case.rglob("*.tmp")]
    problems = []
    if code is None:
        problems.append(f"hung past {TIMEOUT_S:.0f} s")
    if after != before:
        problems.append(f"victim changed: {sorted(set(after.items()) ^ set(before.items()))}")
    if leftovers:
        problems.append(f"left {leftovers}")
    if (case / "kmsg.log").exists():
        problems.append("the fault ran before the log was refused")
    if kind == "hardlink" and whole_file:
        observed = f"exit {code}"
    else:
        observed = f"exit {code}: {lines[-1] if lines else '(no error)'}"
        if code != 2:
            problems.append("not exit 2")
        if len(lines) != 1 or not lines[0].startswith("error: ") or str(target) not in lines[0]:
            problems.append("not one line naming the path")
    if problems:
        observed = f"{observed} [{'; '.join(problems)}]"
    return Row(option.name, kind, expected, observed, ok=not problems)


def _reap(case: Path) -> None:
    """Stop the child that played a worker for `inject`, if it still runs."""
    worker = _WORKERS.pop(case, None)
    if worker is not None:
        worker.kill()
        worker.wait()


# ------------------------------------------------------- a name built from data


class _Worker(http.server.BaseHTTPRequestHandler):
    """A text-only OpenAI completions server (refuses return_token_ids, as HF serve does)."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "return_token_ids" in body:
            self._reply(422, {"detail": "Unexpected fields: return_token_ids"})
            return
        self._reply(200, {"choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}]})

    def do_GET(self) -> None:
        self._reply(200, {"data": [{"id": "m"}]})

    def _reply(self, status: int, doc: object) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        del args


def traversal_row(base: Path) -> Row:
    """`canary record` for a model named `../../../victimdir/x`, default path: the set is
    written inside canaries/ (as `_.--..--..--victimdir--x.yaml`), the victim untouched."""
    case = Path(tempfile.mkdtemp(prefix="case-", dir=base))
    work = case / "a" / "b" / "c"
    work.mkdir(parents=True)
    victim_dir = case / "victimdir"
    victim_dir.mkdir()
    (victim_dir / "x.yaml").write_text(KEEP)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Worker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code, err = _ftctl(["canary", "record", "--url",
                            f"http://127.0.0.1:{server.server_address[1]}", "--model",
                            "../../../victimdir/x", "--repeats", "2", "--warmup-timeout", "5"],
                           cwd=work)
    finally:
        server.shutdown()
        server.server_close()
    inside = sorted(p.name for p in (work / "canaries").glob("*")) if (
        work / "canaries").is_dir() else []
    victim = (victim_dir / "x.yaml").read_text()
    observed = f"exit {code}, canaries/ holds {inside}"
    ok = victim == KEEP and code == 0 and inside == ["_.--..--..--victimdir--x.yaml"]
    if victim != KEEP:
        observed += " [victim overwritten]"
    if code != 0:
        observed += f" [{err.strip().splitlines()[-1:] }]"
    return Row("canary record (default path)", "path traversal",
               "written inside canaries/, victim unchanged", observed, ok=ok)


def run_matrix(options: tuple[Option, ...] = OPTIONS, kinds: tuple[str, ...] = KINDS, *,
               traversal: bool = True) -> list[Row]:
    """Every option against every kind, then (with `traversal`) the data-built name."""
    with tempfile.TemporaryDirectory(prefix="ftctl-hostile-") as raw:
        base = Path(raw)
        rows = [_case(option, kind, base) for option in options for kind in kinds]
        if traversal:
            rows.append(traversal_row(base))
    return rows


def render(rows: list[Row]) -> str:
    """The rows as an aligned text table (what `make chaos` prints)."""
    head = ("option", "kind", "ok", "observed")
    cells = [(r.option, r.kind, "ok" if r.ok else "FAIL", r.observed) for r in rows]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(3)]
    return "\n".join("  ".join([*(c[i].ljust(widths[i]) for i in range(3)), c[3]])
                     for c in [head, *cells])


if __name__ == "__main__":
    matrix = run_matrix()
    sys.stdout.write(render(matrix) + "\n")
    raise SystemExit(0 if all(r.ok for r in matrix) else 1)
