"""The injectors: how one planned step reaches a worker.

A `Step` is data (JSON-able, so pending reverts survive a crash on disk);
`Injectors.execute` carries it out through one seam per side effect:

    signal  os.kill(pid, SIGKILL | SIGTERM | SIGSTOP | SIGCONT), or os.kill(-pgid, …) to a
            whole process group (`process.group`: an engine of several processes)
    http    POST {admin_url}/admin/fault with a bearer token read from the
            environment variable the inventory names (an `http1.Transport`, one shot)
    kmsg    append the exact `NVRM: Xid (PCI:…): N, pid=…, name=…, …` line to
            /dev/kmsg (or a file, for tests), so GPU health agents fire
    dcgm    `dcgmi test --inject --gpuid G -f 230 -v N` (always with --gpuid), run through
            the process seam (`process.Spawner.run`)
    net     the TCP fault proxy's control API (POST/DELETE /toxics) with the bearer
            token from the variable the inventory names (inject.netproxy_token_env)
    load    start or stop a bounded background load process (`faults/overload.py`)

Low-level failures become `FtctlError`s here, once: a vanished pid or a
refused connection is `Unreachable` (exit 3), a rejected request is
`InvalidInput` (exit 2).
"""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dynamo_ftctl.auth import NETPROXY_TOKEN_ENV, bearer_headers, token_from_env
from dynamo_ftctl.errors import InvalidInput, Unreachable
from dynamo_ftctl.http1.transport import Reply, Request, Transport
from dynamo_ftctl.process import SPAWNER, Spawner
from dynamo_ftctl.safefiles import open_device

__all__ = ["InjectorKind", "Injectors", "Step", "xid_kmsg_line"]

InjectorKind = Literal["signal", "http", "kmsg", "dcgm", "net", "load"]
_HTTP_TIMEOUT_S = 5.0
_DCGMI_TIMEOUT_S = 15.0
# DCGM field 230 is DCGM_FI_DEV_XID_ERRORS (dcgm_fields.h): the last Xid seen on the GPU.
DCGM_XID_FIELD = 230



class _LateClient:
    """`http1.BlockingClient`, imported on the first HTTP step (a signal needs no asyncio)."""

    def handle_request(self, request: Request) -> Reply:
        from dynamo_ftctl.http1 import BlockingClient

        return BlockingClient().handle_request(request)


@dataclass(frozen=True)
class Step:
    """One thing an injector does: a signal, a request, a log line or a command."""

    injector: InjectorKind
    target: str
    data: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """Exactly what executing this step does, for `--dry-run` and the audit log."""
        if self.injector == "signal":
            target = f"-- -{self.target}" if self.data.get("group") else self.target
            return f"kill -{self.data['signal'].removeprefix('SIG')} {target}"
        if self.injector == "http":
            body = json.dumps(self.data["body"], separators=(",", ":"))
            return (f"POST {self.target} {body} "
                    f"(Authorization: Bearer ${self.data['token_env']})")
        if self.injector == "kmsg":
            return f"append to {self.target}: {self.data['line']}"
        if self.injector == "dcgm":
            return "run: " + " ".join(self.data["argv"])
        if self.injector == "load":
            if self.data["action"] == "start":
                return (f"start in the background (pid in {self.target}): "
                        + " ".join(self.data["argv"]))
            return f"stop the background load whose pid is in {self.target} (SIGTERM)"
        method = self.data["method"]
        payload = self.data.get("body")
        token_env = self.data.get("token_env", NETPROXY_TOKEN_ENV)
        return f"{method} {self.target}" + (
            f" {json.dumps(payload, separators=(',', ':'))}" if payload is not None else ""
        ) + f" (Authorization: Bearer ${token_env})"

    def to_json(self) -> dict[str, Any]:
        """The step as a JSON object (revert records, reports)."""
        return {"injector": self.injector, "target": self.target, "data": dict(self.data),
                "describe": self.describe()}

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> Step:
        """A step read back from a revert record."""
        return Step(injector=doc["injector"], target=str(doc["target"]), data=doc["data"])


def xid_kmsg_line(xid: int, pci_bus_id: str, pid: int | str, process: str) -> str:
    """The kernel's Xid line, as the NVIDIA driver prints it (`pid='N/A'` when unknown)."""
    from dynamo_ftctl.xid import lookup_xid

    meaning = lookup_xid(xid).meaning
    return f"NVRM: Xid (PCI:{pci_bus_id}): {xid}, pid={pid}, name={process}, {meaning}"


@dataclass
class Injectors:
    """Executes steps; every side effect goes through a replaceable seam."""

    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    transport: Transport = field(default_factory=_LateClient)  # http and net; OSError fails
    kill: Callable[[int, int], None] = os.kill
    spawner: Spawner = SPAWNER  # dcgmi, and the overload fault's load process

    def execute(self, step: Step) -> str:
        """Carry out one step; returns a short outcome ("ok", "HTTP 200", …)."""
        handler = {
            "signal": self._signal, "http": self._http, "kmsg": self._kmsg,
            "dcgm": self._dcgm, "net": self._net, "load": self._load,
        }[step.injector]
        return handler(step)

    def _signal(self, step: Step) -> str:
        pid = int(step.target)
        name = str(step.data["signal"])
        group = bool(step.data.get("group"))
        try:
            # kill(-pgid, sig) signals every process of the group (POSIX kill(2)).
            self.kill(-pid if group else pid, signal.Signals[name].value)
        except ProcessLookupError:
            what = f"process group {pid}" if group else f"process with pid {pid}"
            msg = f"no {what} (already gone?)"
            raise Unreachable(msg) from None
        except PermissionError:
            msg = f"not allowed to signal pid {pid} (run as its user or root)"
            raise InvalidInput(msg) from None
        return f"sent {name} to process group {pid}" if group else f"sent {name}"

    def _request(self, method: str, url: str, body: Any, headers: dict[str, str]) -> str:
        payload = b""
        if body is not None:
            payload = json.dumps(body).encode()
            headers = {**headers, "Content-Type": "application/json"}
        try:
            reply = self.transport.handle_request(
                Request(method, url, payload, headers, _HTTP_TIMEOUT_S))
        except OSError as exc:  # refused, reset, timed out (TimeoutError is an OSError)
            msg = f"{method} {url}: {type(exc).__name__}: {exc or 'timed out'}"
            raise Unreachable(msg) from None
        status = reply.status
        if status >= 400:
            text = reply.body[:200].decode("utf-8", "replace")
            msg = f"{method} {url}: HTTP {status}: {text}"
            raise Unreachable(msg) if status >= 500 else InvalidInput(msg)
        return f"HTTP {status}"

    def _token(self, env: str, what: str) -> str:
        token = token_from_env(env, self.environ)
        if token is None:
            msg = f"the {what} token variable ${env} is not set (the inventory names it)"
            raise InvalidInput(msg)
        return token

    def _http(self, step: Step) -> str:
        token = self._token(str(step.data["token_env"]), "admin")
        return self._request("POST", step.target, step.data["body"], bearer_headers(token))

    def _net(self, step: Step) -> str:
        # Revert records written before the control API took a token name none.
        token = self._token(str(step.data.get("token_env", NETPROXY_TOKEN_ENV)), "fault proxy")
        return self._request(str(step.data["method"]), step.target, step.data.get("body"),
                             bearer_headers(token))

    def _kmsg(self, step: Step) -> str:
        path = Path(step.target)
        line = str(step.data["line"])
        try:
            is_device = stat.S_ISCHR(path.stat().st_mode)
        except FileNotFoundError:
            is_device = False
        # /dev/kmsg takes one record per write; "<4>" is KERN_WARNING, the driver's level.
        record = (f"<4>{line}\n" if is_device else f"{line}\n").encode()
        try:
            # The kernel log, or a regular file standing in for it (tests): nothing else.
            fd = open_device(path, or_log=True)
            try:
                os.write(fd, record)
            finally:
                os.close(fd)
        except PermissionError:
            msg = f"not allowed to write {path} (kernel log needs root or CAP_SYSLOG)"
            raise InvalidInput(msg) from None
        except OSError as exc:
            msg = f"cannot write {path}: {exc.strerror or exc}"
            raise Unreachable(msg) from None
        return f"wrote {len(record)} bytes"

    def _load(self, step: Step) -> str:
        from dynamo_ftctl.faults.overload import start_overload, stop_overload

        if step.data["action"] == "start":
            return start_overload(Path(step.target), [str(a) for a in step.data["argv"]],
                                  spawner=self.spawner)
        return stop_overload(Path(step.target), kill=self.kill, spawner=self.spawner)

    def _dcgm(self, step: Step) -> str:
        argv = [str(a) for a in step.data["argv"]]
        try:
            done = self.spawner.run(argv, timeout_s=_DCGMI_TIMEOUT_S)
        except FileNotFoundError:
            msg = "dcgmi not found on PATH (install DCGM, or drop 'dcgm' from the injectors)"
            raise Unreachable(msg) from None
        if done.timed_out:
            msg = f"{' '.join(argv)}: no answer within {_DCGMI_TIMEOUT_S:g} s"
            raise Unreachable(msg)
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            msg = f"{' '.join(argv)}: exit {done.returncode}: {detail[-1] if detail else ''}"
            raise Unreachable(msg)
        return "ok"
