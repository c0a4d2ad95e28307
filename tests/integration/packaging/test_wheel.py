"""The wheel as users install it: built once, installed into a bare venv per extra set,
and each command run from the installed `ftctl`, so a dependency left undeclared fails here.

- the wheel: tagged `py3-none-<platform>` with the KV row-copy kernel (a plain shared
  library, no Python ABI) where a C compiler built it, `py3-none-any` without; the build
  writes nothing into the tree it builds from. CPython 3.12, 3.13 and 3.14, where the
  machine has them (PATH or pyenv), install it and run the kernel too (skipped, saying
  so, where it has none).
- base (`pip install dynamo-ftctl`): `--help` of every command, and a loopback job for each
  command that needs neither torch nor a GPU (`lock`, `xid`, `gpu kmsg`, `load`, `proxy`,
  `canary --watch`); torch's commands answer with the install hint, exit 2; the man pages
  lie under <venv>/share/man/man1.
- [gpu]: NVML's module imports; `gpu status` fails in one line where no GPU is.
- [sim]: the reference engine serves a completion; the KV copier runs on numpy's path.

The venvs see none of this checkout: PYTHONPATH is dropped and the commands run in a
temporary directory. Under xdist the wheel and each venv are built once per run (a lock in
the run's shared temporary directory). The torch of [sim] comes from pip's cache or
find-links, pinned by constraints.txt (`make test`'s own rule).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
# What the build reads: the wheel is built from a copy, so the build hook's kernel never
# lands in this checkout while other tests load it.
BUILD_INPUTS = ("pyproject.toml", "hatch_build.py", "README.md", "src", "man")
EXTRA_MODULES = ("torch", "tokenizers", "numpy", "pynvml", "matplotlib")
INSTALL_TIMEOUT_S = 300  # [sim]: 36 s measured on a busy 2-core VM (torch from find-links)
COMMAND_TIMEOUT_S = 60
# Variables that would let an installed ftctl see this checkout or this user's files.
HIDDEN_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "FTCTL_INVENTORY", "MANPATH",
              "VIRTUAL_ENV")

# Other CPythons the wheel must install on (requires-python >= 3.11), where this machine has
# them: on PATH, or installed by pyenv (whose PATH shims answer only its selected version).
OTHER_PYTHONS = ("3.12", "3.13", "3.14")
# Run inside a venv: the row-copy kernel the installed package loads, from where, and whether
# it copies rows (no torch: a ctypes buffer of 4 rows of 8 bytes, rows 2,0 -> rows 1,3).
LOAD_KERNEL = """
import ctypes, json, sys
from dynamo_ftctl.kv import native

class Ids:  # what the kernel reads of a torch id tensor: its address and length
    def __init__(self, *values):
        self.values, self.shape = (ctypes.c_int64 * len(values))(*values), (len(values),)
    def data_ptr(self):
        return ctypes.addressof(self.values)

k = native.kernel()
rows = None
if k is not None:
    src, dst = (ctypes.c_uint8 * 32)(*range(32)), (ctypes.c_uint8 * 32)()
    status = k.copy_blocks([ctypes.addressof(dst), ctypes.addressof(src), 8, 8], Ids(1, 3),
                           Ids(2, 0), dst_blocks=4, src_blocks=4, row_bytes=8, threads=1)
    rows = [status, [bytes(dst)[i * 8] for i in range(4)]]
print(json.dumps({"path": str(k.path) if k else None, "library": str(native.LIBRARY),
                  "team": k.team if k else None, "rows": rows,
                  "python": sys.version_info[:2]}))
"""
# Run inside a venv: `--help` of every command and subcommand, in one process; prints
# {"ftctl lock acquire": exit code, ...}.
HELP_OF_EVERY_COMMAND = """
import contextlib, io, json, click, typer
from dynamo_ftctl.cli.main import app, main

def walk(command, path):
    yield path
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            yield from walk(command.get_command(ctx, name), [*path, name])

codes = {}
for path in walk(typer.main.get_command(app), []):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main([*path, "--help"])
    codes[" ".join(["ftctl", *path])] = rc if "Usage:" in out.getvalue() else "no usage"
print(json.dumps(codes))
"""


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HIDDEN_ENV}
    env.update(XDG_STATE_HOME=str(home / "state"), PYTHONUNBUFFERED="1", **extra)
    return env


def _once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """`make(dir)` once per test run, shared by every xdist worker; the dir."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    target = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (target / ".done").exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            make(target)
            (target / ".done").touch()
    return target


def _run(argv: list[str], *, cwd: Path, env: dict[str, str],
         timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _checked(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> None:
    done = _run(argv, cwd=cwd, env=env, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built by pip from a copy of its sources."""

    def build(out: Path) -> None:
        tree = out / "tree"
        tree.mkdir()
        for name in BUILD_INPUTS:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns(
                    "__pycache__", "*.so", "*.tmp"))
            else:
                shutil.copy2(source, tree / name)
        # No build isolation: hatchling is in the dev extra, so the build needs no index.
        _checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--quiet", "--wheel-dir", str(out), str(tree)],
                 cwd=out, env=_clean_env(out), timeout=300)

    out = _once(tmp_path_factory, "wheel", build)
    (found,) = out.glob("dynamo_ftctl-*.whl")
    return found


def _venv(factory: pytest.TempPathFactory, wheel: Path, extras: str) -> Path:
    """A bare venv (no system site-packages) with the wheel and `extras` installed."""

    def create(venv: Path) -> None:
        env = _clean_env(venv)
        _checked([sys.executable, "-m", "venv", str(venv)], cwd=venv, env=env, timeout=120)
        spec = f"{wheel}[{extras}]" if extras else str(wheel)
        # --no-compile: byte-compiling torch's ~10k files took ~4 of the ~5 minutes.
        _checked([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                  "--no-compile", "--disable-pip-version-check",
                  "-c", str(ROOT / "constraints.txt"), spec],
                 cwd=venv, env=env, timeout=INSTALL_TIMEOUT_S)

    return _once(factory, f"venv-{extras or 'base'}", create)


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """`pip install dynamo-ftctl`: the base install."""
    return _venv(tmp_path_factory, wheel, "")


@pytest.fixture
def in_venv(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run a venv's command in an empty directory with a clean environment."""

    def run(venv: Path, *argv: str, timeout: float = COMMAND_TIMEOUT_S,
            **env: str) -> subprocess.CompletedProcess[str]:
        return _run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=tmp_path,
                    env=_clean_env(tmp_path, **env), timeout=timeout)

    return run


class Served:
    """A long-running command of a venv: its URL, read from the line it prints when ready."""

    def __init__(self, venv: Path, argv: list[str], cwd: Path, ready: str) -> None:
        self.log = cwd / f"{argv[0]}-{os.getpid()}-{time.monotonic_ns()}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd,
                                         env=_clean_env(cwd), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.url = self._await(re.compile(ready, re.MULTILINE))

    def _await(self, pattern: re.Pattern[str]) -> str:
        def log() -> str:
            text = self.log.read_text()
            assert pattern.search(text) or self.proc.poll() is None, (
                f"exited {self.proc.returncode}: {self.output}")
            return text

        text = wait_until(log, COMMAND_TIMEOUT_S, f"the ready line /{pattern.pattern}/",
                          accept=pattern.search, interval=0.05)
        found = pattern.search(text)
        assert found is not None
        return found.group(1)

    @property
    def output(self) -> str:
        return self.log.read_text()[-3000:]

    def stop(self) -> int:
        """SIGTERM, as a supervisor stops it; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Path, list[str], str], Served]]:
    """Start venv commands that serve; each is killed at teardown if still running."""
    started: list[Served] = []

    def start(venv: Path, argv: list[str], ready: str) -> Served:
        served = Served(venv, argv, tmp_path, ready)
        started.append(served)
        return served

    yield start
    for served in started:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()


def _get(url: str, body: dict[str, object] | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=COMMAND_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _inventory(directory: Path) -> Path:
    """One worker nobody serves (port 9, discard), the proxy and the daemon on free ports."""
    shutil.copy2(ROOT / "canaries" / "ftctl-sim-tiny.yaml", directory / "canaries.yaml")
    path = directory / "inv.yaml"
    path.write_text(
        "cluster: smoke\n"
        "workers:\n"
        "  - {name: w1, url: 'http://127.0.0.1:9', model: ftctl-sim-tiny, node: localhost}\n"
        "canary: {set: canaries.yaml, listen: '127.0.0.1:0'}\n"
        "proxy: {listen: '127.0.0.1:0'}\n")
    return path


# --- the wheel ---------------------------------------------------------------------------


def _tag(wheel: Path) -> str:
    """The wheel's python-abi-platform tag, from its file name."""
    return "-".join(wheel.name.removesuffix(".whl").split("-")[-3:])


def test_wheel_is_py3_none_platform_with_the_kernel(wheel: Path) -> None:
    """With a C compiler the wheel ships the kernel and is tagged py3-none-<platform> (no
    Python ABI: one wheel for every CPython >= 3.11); without one it is py3-none-any."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (wheel_file,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
        metadata = archive.read(wheel_file).decode()
    tag = _tag(wheel)
    if shutil.which("cc") is None:
        assert tag == "py3-none-any"
        assert "dynamo_ftctl/kv/_rowcopy.so" not in names
        pytest.skip("no C compiler: the wheel is pure, without the kernel")
    assert tag.startswith("py3-none-")
    assert tag != "py3-none-any"
    assert "dynamo_ftctl/kv/_rowcopy.so" in names
    assert "Root-Is-Purelib: false" in metadata
    assert f"Tag: {tag}" in metadata


def test_wheel_build_writes_nothing_into_its_source_tree(wheel: Path) -> None:
    """The build hook compiles into its own temporary directory: the tree the wheel was
    built from holds no library and no partial file afterwards."""
    tree = wheel.parent / "tree"
    assert tree.is_dir()
    assert [str(p) for p in tree.rglob("*") if p.suffix in (".so", ".tmp")] == []


def test_base_install_loads_the_wheels_kernel(base_venv: Path, in_venv) -> None:
    """The installed package loads the kernel the wheel shipped (not a cached build: the
    cache is off), without torch (the kernel's own thread pool)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: the wheel ships no kernel")
    done = in_venv(base_venv, "python", "-c", LOAD_KERNEL, FTCTL_NO_CACHE="1")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["path"] == found["library"], found
    assert found["path"].startswith(str(base_venv)), found
    assert found["team"] == "pool"
    assert found["rows"] == [0, [0, 16, 0, 0]]  # row 2 (bytes 16..) -> row 1, row 0 -> row 3


def _interpreter(version: str) -> str | None:
    """A CPython `version` (\"3.12\") that runs on this machine: `python3.12` on PATH, else
    pyenv's installed one; None where there is none."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    candidates = [shutil.which(f"python{version}"),
                  *sorted(str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}"))]
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                                  capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == str(tuple(map(int, version.split(".")))):
            return candidate
    return None


@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_wheel_installs_on_another_cpython(
    tmp_path_factory: pytest.TempPathFactory, wheel: Path, in_venv, version: str,
) -> None:
    """pip of another CPython takes the same wheel (its tag names no Python version) and
    the package loads and runs its kernel there."""
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        pytest.skip(f"{version} is the interpreter that built the wheel")
    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no CPython {version} on this machine (PATH, pyenv)")
    venv = tmp_path_factory.mktemp(f"venv-{version}")
    env = _clean_env(venv)
    _checked([python, "-m", "venv", str(venv)], cwd=venv, env=env, timeout=120)
    # --no-deps: the tag is what is checked; the other dependencies need an index
    _checked([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
              "--no-compile", "--disable-pip-version-check", str(wheel)],
             cwd=venv, env=env, timeout=INSTALL_TIMEOUT_S)
    done = in_venv(venv, "python", "-c", LOAD_KERNEL, FTCTL_NO_CACHE="1")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert ".".join(map(str, found["python"])) == version
    if shutil.which("cc") is not None:
        assert found["path"] == found["library"], found
        assert found["path"].startswith(str(venv)), found
        assert found["rows"] == [0, [0, 16, 0, 0]]


# --- base --------------------------------------------------------------------------------


def test_base_install_is_the_wheel_without_any_extra(base_venv: Path, in_venv) -> None:
    """The base venv imports ftctl from itself and has none of the extras' modules."""
    probe = ("import importlib.util, json, dynamo_ftctl; print(json.dumps([dynamo_ftctl.__file__,"
             f" [m for m in {EXTRA_MODULES!r} if importlib.util.find_spec(m)]]))")
    done = in_venv(base_venv, "python", "-c", probe)
    assert done.returncode == 0, done.stderr
    where, present = json.loads(done.stdout)
    assert where.startswith(str(base_venv))
    assert present == []


def test_base_install_answers_help_of_every_command(base_venv: Path, in_venv) -> None:
    """`--help` of each command and subcommand prints usage and exits 0."""
    done = in_venv(base_venv, "python", "-c", HELP_OF_EVERY_COMMAND)
    assert done.returncode == 0, done.stderr
    codes = json.loads(done.stdout)
    assert len(codes) > 30  # the walk reached the subcommands, not only the groups
    assert {path: rc for path, rc in codes.items() if rc != 0} == {}


def test_base_install_runs_lock_xid_and_gpu_kmsg(base_venv: Path, in_venv,
                                                 tmp_path: Path) -> None:
    """lock runs a command holding the lock; xid explains 48; gpu kmsg finds a logged Xid."""
    lock = in_venv(base_venv, "ftctl", "lock", "acquire", "--path", str(tmp_path / "f.lock"),
                   "--timeout", "5", "--", "true")
    assert lock.returncode == 0, lock.stderr
    xid = in_venv(base_venv, "ftctl", "xid", "48")
    assert xid.returncode == 0, xid.stderr
    assert "Double Bit ECC" in xid.stdout
    (tmp_path / "kern.log").write_text(
        "Nov 25 10:00:00 h kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python, DBE\n")
    kmsg = in_venv(base_venv, "ftctl", "gpu", "kmsg", "--source", str(tmp_path / "kern.log"),
                   "--pci-map", "0000:3b:00=0", "--json")
    assert kmsg.returncode == 1, kmsg.stderr  # 1: an actionable Xid was found
    assert json.loads(kmsg.stdout.splitlines()[0])["xid"] == 48


def test_base_install_load_runs_against_the_loopback_target(base_venv: Path, in_venv,
                                                             serve) -> None:
    """`ftctl load` completes every request against the packaged loopback target."""
    target = serve(base_venv, ["python", "-m", "dynamo_ftctl.loadgen.target", "--port", "0"],
                   r"listening on (127\.0\.0\.1:\d+)")
    done = in_venv(base_venv, "ftctl", "load", "--url", f"http://{target.url}", "--users", "1",
                   "--requests", "5", "--max-tokens", "4", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["completed"], report["failed"]) == (5, 0)


def test_base_install_serves_the_proxy(base_venv: Path, serve, tmp_path: Path) -> None:
    """`ftctl proxy` (httpserver, uvloop) starts, answers /health, stops on SIGTERM."""
    inventory = _inventory(tmp_path)
    proxy = serve(base_venv, ["ftctl", "-i", str(inventory), "proxy"],
                  r"serving 1 workers on (http://\S+)")
    status, _ = _get(f"{proxy.url}/health")
    assert status in (200, 503)  # it answers; no worker is up, so not necessarily healthy
    assert proxy.stop() == 0, proxy.output
    assert "Traceback" not in proxy.output


def test_base_install_serves_the_canary_daemon(base_venv: Path, serve, tmp_path: Path) -> None:
    """`ftctl canary --watch` (httpserver) probes, answers /health, stops on SIGTERM."""
    inventory = _inventory(tmp_path)
    daemon = serve(base_venv, ["ftctl", "-i", str(inventory), "canary", "--watch"],
                   r"serving (http://\S+)")
    status, body = _get(f"{daemon.url}/health")
    assert status == 200, body
    assert json.loads(body)["status"] == "ok"
    assert daemon.stop() == 0, daemon.output
    assert "Traceback" not in daemon.output


@pytest.mark.parametrize("argv", [
    ["sim", "serve", "--port", "0"],
    ["kv", "bench", "--blocks", "16"],
])
def test_base_install_names_the_sim_extra(base_venv: Path, in_venv, argv: list[str]) -> None:
    """A torch command in the base install: one line with the install hint, exit 2."""
    done = in_venv(base_venv, "ftctl", *argv)
    assert done.returncode == 2, done.stderr
    assert "pip install 'dynamo-ftctl[sim]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_base_install_ships_the_man_pages(base_venv: Path, tmp_path: Path) -> None:
    """Every page of man/ is installed under <venv>/share/man/man1, where `man` finds it."""
    pages = sorted(p.name for p in (ROOT / "man").glob("*.1"))
    installed = base_venv / "share" / "man" / "man1"
    assert sorted(p.name for p in installed.glob("*.1")) == pages
    for page in pages:
        assert (installed / page).read_bytes() == (ROOT / "man" / page).read_bytes()
    if shutil.which("man") is None:
        pytest.skip("man is not installed (make debs installs man-db)")
    # man-db looks for ../share/man beside each PATH entry: the venv's bin is enough.
    env = _clean_env(tmp_path, PATH=f"{base_venv / 'bin'}:{os.environ.get('PATH', '')}")
    found = _run(["man", "-w", "ftctl"], cwd=tmp_path, env=env)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(installed / "ftctl.1")


# --- [gpu] -------------------------------------------------------------------------------


def test_gpu_install_imports_nvml(tmp_path_factory: pytest.TempPathFactory, wheel: Path,
                                  in_venv) -> None:
    """[gpu] brings pynvml; `gpu status` answers (exit 3 in one line where no GPU is)."""
    venv = _venv(tmp_path_factory, wheel, "gpu")
    done = in_venv(venv, "python", "-c", "import pynvml")
    assert done.returncode == 0, done.stderr
    status = in_venv(venv, "ftctl", "gpu", "status")
    assert status.returncode in (0, 1, 3), status.stderr
    assert "Traceback" not in status.stderr
    if status.returncode == 3:
        assert len(status.stderr.strip().splitlines()) == 1, status.stderr


# --- [sim] -------------------------------------------------------------------------------


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)
def test_sim_install_serves_a_completion_and_copies_kv(
    tmp_path_factory: pytest.TempPathFactory, wheel: Path, in_venv, serve,
) -> None:
    """[sim]: the reference engine (torch, BPE tokenizer) completes; the KV copier runs."""
    venv = _venv(tmp_path_factory, wheel, "sim")
    engine = serve(venv, ["ftctl", "sim", "serve", "--port", "0"], r"^(http://\S+)$")
    status, body = _get(f"{engine.url}/v1/completions",
                        {"model": "ftctl-sim-tiny", "prompt": "hello", "max_tokens": 4})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"]
    assert engine.stop() == 0, engine.output  # SIGTERM: answers finished, exit 0
    assert "Traceback" not in engine.output
    # random ids with the torch kernel: the id checks run on numpy's view (kv/copy.py)
    bench = in_venv(venv, "ftctl", "kv", "bench", "--blocks", "64", "--sweep-kib", "",
                    "--patterns", "random", "--repeats", "1", "--kernel", "torch", "--json",
                    timeout=120)
    assert bench.returncode == 0, bench.stderr
