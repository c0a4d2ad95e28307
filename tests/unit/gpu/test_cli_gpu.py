"""`ftctl xid` and `ftctl gpu`: real processes for output, exit codes and start-up weight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from dynamo_ftctl.xid import XID_CATALOG

ROOT = Path(__file__).resolve().parents[3]

INVENTORY = """\
cluster: test
workers:
  - {name: w1, url: "http://127.0.0.1:8101", model: m, node: node-a, gpus: [0, 1]}
  - {name: w2, url: "http://127.0.0.1:8102", model: m, node: node-a, gpus: [2, 3]}
  - {name: w3, url: "http://127.0.0.1:8103", model: m, node: node-b, gpus: [0]}
"""

KERN_LOG = """\
[  10.000000] pci 0000:3b:00.0: enabling device
[ 966.503025] NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=vllm, An uncorrectable double bit error
[ 967.000000] NVRM: Xid (PCI:0000:86:00): 63, pid=1234, Row Remapper: New row marked for remapping
[ 968.000000] NVRM: Xid (PCI:garbage): 48
"""


def ftctl(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
          cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    full_env.pop("FTCTL_INVENTORY", None)
    full_env.pop("FTCTL_FAKE_NVML", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True, text=True,
        timeout=60, env=full_env, cwd=cwd, input=stdin, check=False,
    )


def lines(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    return path


def test_xid_explains_one_code() -> None:
    """`ftctl xid 48 --json` prints the catalog entry and exits 0."""
    proc = ftctl("xid", "48", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["code"] == 48
    assert doc["action"] == "RESET_GPU"
    assert doc["effect"] == "crash"
    human = ftctl("xid", "79")
    assert human.returncode == 0
    assert "RESTART_BM" in human.stdout


def test_xid_unknown_or_missing_code_exits_2() -> None:
    """An unknown code or no code at all is one error line and exit 2."""
    unknown = ftctl("xid", "9999")
    assert unknown.returncode == 2
    assert unknown.stdout == ""
    assert unknown.stderr.count("\n") == 1
    assert "9999" in unknown.stderr
    assert ftctl("xid").returncode == 2


def test_xid_list() -> None:
    """`ftctl xid --list --json` lists every cataloged code in order."""
    proc = ftctl("xid", "--list", "--json")
    assert proc.returncode == 0
    assert [d["code"] for d in json.loads(proc.stdout)] == sorted(XID_CATALOG)
    table = ftctl("xid", "--list")
    assert "Uncontained ECC error" in table.stdout


def test_mtbf() -> None:
    """`ftctl gpu mtbf` prints the fleet figures."""
    proc = ftctl("gpu", "mtbf", "--gpus", "1024", "--afr", "0.03", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert round(doc["fleet_mtbf_hours"]) == 285
    assert ftctl("gpu", "mtbf", "--gpus", "8", "--afr", "3").returncode == 2


def test_kmsg_file_gives_events_with_workers(inventory: Path) -> None:
    """A kernel log file yields one JSON line per Xid, the worker on its GPU, and exit 1."""
    log = inventory.parent / "kern.log"
    log.write_text(KERN_LOG)
    proc = ftctl("-i", str(inventory), "gpu", "kmsg", "--source", str(log), "--node", "node-a",
                 "--pci-map", "0000:3b:00=2,0000:86:00=0", "--json")
    assert proc.returncode == 1, proc.stderr
    events = lines(proc.stdout)
    assert [(e["xid"], e["gpu"], e["action"], e["workers"]) for e in events] == [
        (48, 2, "RESET_GPU", ["w2"]), (63, 0, "IGNORE", ["w1"]),
    ]
    assert "4 lines read, 2 Xid events (1 actionable), 1 malformed" in proc.stderr


def test_kmsg_stdin_without_actionable_events_exits_0() -> None:
    """Stdin is read to its end; nothing actionable means exit 0."""
    proc = ftctl("gpu", "kmsg", "--source", "-", "--pci-map", "0000:86:00=0",
                 stdin="hello\nNVRM: Xid (PCI:0000:86:00): 92, pid=1, name=x, High SBE rate\n")
    assert proc.returncode == 0, proc.stderr
    assert "xid 92" in proc.stdout


def _spec(tmp_path: Path, spec: dict[str, object]) -> dict[str, str]:
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(spec))
    return {"FTCTL_FAKE_NVML": str(path)}


def test_status_with_fake_nvml(tmp_path: Path) -> None:
    """`gpu status --json` reports each GPU; a GPU with a problem makes it exit 1."""
    healthy = ftctl("gpu", "status", "--json", env=_spec(tmp_path, {"gpus": 2}))
    assert healthy.returncode == 0, healthy.stderr
    doc = json.loads(healthy.stdout)
    assert doc["healthy"] is True
    assert len(doc["gpus"]) == 2
    sick = ftctl("gpu", "status", env=_spec(tmp_path, {"gpus": [
        {"index": 0, "remap_failure": True, "throttle_mask": 8}]}))
    assert sick.returncode == 1
    assert "row remapping failed" in sick.stdout


def test_status_without_driver_exits_3() -> None:
    """Without an NVIDIA driver `gpu status` says so in one line and exits 3."""
    proc = ftctl("gpu", "status")
    if proc.returncode == 0:
        pytest.skip("an NVIDIA driver is present on this host")
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")


def test_status_without_the_gpu_extra_exits_2_with_the_hint(tmp_path: Path) -> None:
    """Without pynvml (a base install) `gpu status` names the gpu extra in one line and
    exits 2, as README's exit codes and every other missing extra do."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pynvml'\", name='pynvml')\n")
    path = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))
    proc = ftctl("gpu", "status", env={"PYTHONPATH": path})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("error: this command needs pynvml, from the gpu extra: "
                           "pip install 'dynamo-ftctl[gpu]'\n")


def test_bad_fake_spec_exits_2(tmp_path: Path) -> None:
    """A broken fake NVML spec is bad input."""
    path = tmp_path / "bad.json"
    path.write_text("{")
    assert ftctl("gpu", "status", env={"FTCTL_FAKE_NVML": str(path)}).returncode == 2


class _Daemon(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        _Daemon.bodies.append({"path": self.path, **json.loads(self.rfile.read(length)),
                               "authorization": self.headers.get("Authorization")})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_watch_reports_xid_48_to_the_canary_daemon(tmp_path: Path, inventory: Path) -> None:
    """`gpu watch --report` posts an Xid 48 on GPU 2 as w2 ok=false with the daemon's token."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Daemon)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Daemon.bodies.clear()
    try:
        env = _spec(tmp_path, {"gpus": 4, "script": [
            {"xids": [[2, 48]], "set": {"2": {"ecc_volatile_uncorrected": 1}}}]})
        env["FTCTL_DAEMON_TOKEN"] = "d4emon"
        proc = ftctl("-i", str(inventory), "gpu", "watch", "--node", "node-a", "--interval",
                     "0.01", "--count", "2", "--json", "--report",
                     f"http://127.0.0.1:{server.server_address[1]}", env=env)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert proc.returncode == 1, proc.stderr
    events = lines(proc.stdout)
    assert [(e["kind"], e["gpu"], e["action"]) for e in events] == [
        ("xid", 2, "RESET_GPU"), ("ecc", 2, "RESET_GPU"),
    ]
    assert _Daemon.bodies[0] == {
        "path": "/report", "worker": "w2", "ok": False, "source": "gpu",
        "reason": "xid 48: Double Bit ECC Error (uncorrectable memory error) (RESET_GPU)",
        "authorization": "Bearer d4emon",
    }
    assert len(_Daemon.bodies) == 2


def test_gpu_help_stays_light() -> None:
    """`ftctl gpu --help` and `ftctl xid 48` import neither pynvml, httpx nor prometheus."""
    for args in (("gpu", "--help"), ("xid", "48")):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "dynamo_ftctl", *args],
            capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr
        loaded = {
            line.rsplit("|", 1)[1].strip().split(".")[0]
            for line in proc.stderr.splitlines() if line.startswith("import time:")
        }
        assert not loaded & {"pynvml", "httpx", "prometheus_client", "torch"}, args


FAKE_JOURNALCTL = """#!/bin/sh
# A stand-in for journalctl: checks the flags ftctl passes and prints journal lines.
echo "$@" > "$(dirname "$0")/argv"
case " $* " in *" -k "*) ;; *) echo "not asked for kernel messages" >&2; exit 64;; esac
cat <<'LOG'
2026-11-23T10:00:00+0000 node-a kernel: pci 0000:3b:00.0: enabling device
2026-11-23T10:00:01+0000 node-a kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=77, name=vllm, GPU has fallen off the bus.
LOG
"""


def test_kmsg_journal_source_reads_journalctl_k(inventory: Path) -> None:
    """--source journal runs `journalctl -k` and parses its short-iso lines like kmsg."""
    bin_dir = inventory.parent / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "journalctl"
    fake.write_text(FAKE_JOURNALCTL)
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = ftctl("-i", str(inventory), "gpu", "kmsg", "--source", "journal", "--node", "node-a",
                 "--pci-map", "0000:3b:00=1", "--json", env=env)
    assert proc.returncode == 1, proc.stderr
    assert [(e["xid"], e["gpu"], e["action"], e["workers"]) for e in lines(proc.stdout)] == [
        (79, 1, "RESTART_BM", ["w1"]),
    ]
    assert (bin_dir / "argv").read_text().split() == ["-k", "-o", "short-iso", "--no-pager"]


def test_kmsg_journal_source_without_journalctl_exits_3(tmp_path: Path) -> None:
    """With no journalctl on PATH, --source journal is one line and exit 3 (unreachable)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = ftctl("gpu", "kmsg", "--source", "journal", "--pci-map", "0000:3b:00=0",
                 env={"PATH": str(empty)})
    assert proc.returncode == 3, proc.stderr
    assert "cannot run journalctl" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
