"""Run a command on a pseudo-terminal, as a person at a terminal would, bounded in time."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path


def run_on_a_terminal(args: list[str], *, cwd: Path, deadline_s: float,
                      columns: int | None = None) -> tuple[int, str]:
    """Run `args` with stdout and stderr on a pseudo-terminal (`columns` wide); its exit
    code and everything it wrote there. Killed at `deadline_s`."""
    main, child = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS")}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=child, stderr=child,
                            cwd=cwd, env={**env, "TERM": "xterm-256color",
                                          "FTCTL_NO_CACHE": "1"})
    os.close(child)
    chunks: list[bytes] = []
    deadline = time.monotonic() + deadline_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: the child side closed
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(main)
    return code, b"".join(chunks).decode(errors="replace")
