"""Start and stop NVIDIA Dynamo stacks (frontend + mockers) in a network namespace.

Dynamo's mocker binds its ZMQ publishers on 0.0.0.0, on ports the OS picks, and has no flag
to say otherwise; so every stack runs inside a network namespace the test creates
(`ip netns add ftctl-<random>`, loopback up, nothing else): nothing it opens is reachable
from outside, and two stacks cannot take each other's ports. What talks to a stack (ftctl
commands, the proxy, client.py) runs inside it with `ip netns exec`. The rest is bound to
127.0.0.1 through Dynamo's DYN_*_HOST variables.

One stack is one frontend (`--router-mode round-robin --migration-limit 3`) and its mockers,
found through a file discovery directory of their own (`DYN_FILE_KV`): two stacks in one
namespace do not see each other's workers. Every process runs in its own session (a Ctrl-C
at the terminal reaches pytest only); `Stack.stop` and `Namespace.delete` (teardown, also
after an interrupt) SIGCONT + SIGTERM each process group, SIGKILL it after a deadline, and
delete the namespace. `cleanup_all` does it for whatever is left at the end of the session.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.reaper import forget, popen_group
from tests.waiting import wait_until

HERE = Path(__file__).parent
REPO = HERE.parents[2]
CLIENT = HERE / "client.py"
MODEL = "tiny-llama"
STOP_DEADLINE_S = 10.0
START_DEADLINE_S = 90.0  # serves ~3 s after start on an idle machine
# Hosts Dynamo binds (names from dynamo/common/snapshot/constants.py and the frontend's args).
HOST_ENV = dict.fromkeys(("DYN_HTTP_HOST", "DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"), "127.0.0.1")
PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]

_LIVE: list[Proc] = []
_NAMESPACES: list[Namespace] = []


def pinned_version() -> str:
    """The ai-dynamo version `make dynamo` installs (requirements.txt beside this file)."""
    match = re.search(r"^ai-dynamo==(\S+)$", (HERE / "requirements.txt").read_text(), re.M)
    assert match, "tests/integration/dynamo/requirements.txt pins no ai-dynamo version"
    return match.group(1)


def ftctl_cache() -> Path:
    """~/.cache/ftctl (not $XDG_CACHE_HOME: tests/conftest.py points it at a temp dir)."""
    return Path.home() / ".cache" / "ftctl"


def dynamo_python() -> Path:
    """The Dynamo venv's python: $FTCTL_DYNAMO_PYTHON, else where `make dynamo` puts it."""
    default = ftctl_cache() / f"dynamo-{pinned_version()}" / "bin" / "python"
    return Path(os.environ.get("FTCTL_DYNAMO_PYTHON") or default)


def tokenizer_dir(python: Path) -> Path:
    """The tiny Llama's tokenizer + config.json (no weights: the mocker loads none), written
    on first use into ~/.cache/ftctl/models by write_tokenizer.py under the Dynamo venv,
    keyed by a hash of the two scripts and the corpus (the README and the man pages)."""
    scripts = (HERE / "write_tokenizer.py", HERE.parent / "vllm" / "write_tiny_llama.py")
    corpus = (REPO / "README.md", *sorted((REPO / "man").glob("*.1")))
    digest = hashlib.sha256()
    for path in (*scripts, *corpus):
        digest.update(path.read_bytes())
    out = ftctl_cache() / "models" / f"tiny-llama-tokenizer-{digest.hexdigest()[:16]}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([str(python), str(scripts[0]), str(out), *map(str, corpus)],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"writing the tokenizer failed:\n{done.stderr[-3000:]}"
    return out


def can_make_namespaces() -> str | None:
    """Why this machine cannot run the stacks (None: it can)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "`ip netns add` needs root"
    return None


@dataclass
class Namespace:
    """A network namespace with loopback up, deleted by `delete`."""

    name: str

    @classmethod
    def create(cls) -> Namespace:
        ns = cls(f"ftctl-{secrets.token_hex(4)}")
        subprocess.run(["ip", "netns", "add", ns.name], check=True, timeout=30)
        _NAMESPACES.append(ns)
        subprocess.run(["ip", "netns", "exec", ns.name, "ip", "link", "set", "lo", "up"],
                       check=True, timeout=30)
        return ns

    def argv(self, *argv: str) -> list[str]:
        """`argv` run inside the namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, *argv: str, timeout: float = 120, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*argv), capture_output=True, text=True,
                              timeout=timeout, check=False, env=env)

    def client(self, *args: str, timeout: float = 120) -> dict[str, Any]:
        """client.py ARGS inside the namespace, its JSON document."""
        done = self.run(sys.executable, str(CLIENT), *args, timeout=timeout)
        assert done.stdout.strip(), f"client.py {args[0]} printed nothing:\n{done.stderr}"
        doc: dict[str, Any] = json.loads(done.stdout)
        return doc

    def ftctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`ftctl ARGS` inside the namespace, as a user runs it."""
        return self.run(sys.executable, "-m", "dynamo_ftctl", *args, timeout=timeout)

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True, timeout=30,
                       check=False)
        with contextlib.suppress(ValueError):
            _NAMESPACES.remove(self)


@dataclass
class Proc:
    """One process (own session) started inside a namespace, its output in `log`."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGCONT (a stopped process takes no SIGTERM) + SIGTERM the group; SIGKILL it after
        STOP_DEADLINE_S."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_DEADLINE_S)
        self.signal(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(STOP_DEADLINE_S)
        forget(self.proc.pid)
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)


def spawn(ns: Namespace, name: str, argv: list[str], log: Path, env: dict[str, str]) -> Proc:
    with log.open("wb") as out:
        proc = popen_group(ns.argv(*argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                           stdin=subprocess.DEVNULL)
    started = Proc(name, proc, log)
    _LIVE.append(started)
    return started


@dataclass
class Stack:
    """A frontend on 127.0.0.1:port in `ns` and its mockers (one file discovery dir)."""

    ns: Namespace
    name: str
    port: int
    python: Path
    model_dir: Path
    workdir: Path
    frontend: Proc | None = None
    mockers: list[Proc] = field(default_factory=list)
    instances: dict[str, int] = field(default_factory=dict)  # instance id (hex) -> pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **HOST_ENV, "DYN_FILE_KV": str(self.workdir / "kv"),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DYN_LOG": "info"}

    def start_frontend(self) -> None:
        self.frontend = spawn(self.ns, f"{self.name}-frontend", [
            str(self.python), "-m", "dynamo.frontend", "--http-port", str(self.port), *PLANES,
            "--router-mode", "round-robin", "--migration-limit", "3"],
            self.workdir / "frontend.log", self.env)

    def add_mocker(self, deadline_s: float = START_DEADLINE_S) -> Proc:
        """Start a mocker and wait until it registered (a new instance file): its instance id
        is known then, and names the pid that serves a stream (nvext.worker_id)."""
        known = set(self._instance_ids())
        mocker = spawn(self.ns, f"{self.name}-mocker{len(self.mockers) + 1}", [
            str(self.python), "-m", "dynamo.mocker", "--model-path", str(self.model_dir),
            "--model-name", MODEL, *PLANES],
            self.workdir / f"mocker{len(self.mockers) + 1}.log", self.env)
        self.mockers.append(mocker)

        def new_ids() -> set[str]:
            assert mocker.alive, f"{mocker.name} exited:\n{mocker.log_text()[-3000:]}"
            return set(self._instance_ids()) - known

        try:
            new = wait_until(new_ids, deadline_s, f"{mocker.name} registered", interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{mocker.log_text()[-3000:]}") from None
        self.instances[new.pop()] = mocker.pid
        return mocker

    def _instance_ids(self) -> list[str]:
        root = self.workdir / "kv" / "v1" / "instances"
        if not root.is_dir():
            return []
        return [p.name.rsplit("%2F", 1)[1] for p in root.iterdir()
                if p.name.startswith("dynamo%2Fbackend%2Fgenerate%2F")]

    def wait_serving(self, deadline_s: float = START_DEADLINE_S) -> None:
        """Until the frontend lists the model and answers a completion."""
        doc = self.ns.client("wait", self.url, MODEL, str(deadline_s), timeout=deadline_s + 30)
        assert self.frontend is not None
        assert doc["ready"], (f"{self.name} not serving: {doc['last']}\n"
                              f"{self.frontend.log_text()[-3000:]}")

    def stop(self) -> None:
        for proc in [*self.mockers, *([self.frontend] if self.frontend else [])]:
            proc.stop()


def start_stack(ns: Namespace, name: str, port: int, python: Path, model_dir: Path,
                workdir: Path, mockers: int = 1) -> Stack:
    """A frontend and `mockers` mockers, serving."""
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(ns, name, port, python, model_dir, workdir)
    stack.start_frontend()
    for _ in range(mockers):
        stack.add_mocker()
    stack.wait_serving()
    return stack


def cleanup_all() -> None:
    """Stop every process still running and delete every namespace still there."""
    for proc in list(_LIVE):
        proc.stop()
    for ns in list(_NAMESPACES):
        ns.delete()
