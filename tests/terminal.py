"""Run a command on a pseudo-terminal, as a person at a terminal would, bounded in time."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path

from tests.waiting import wait_until


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

    def finished() -> bool:
        """Read what the command wrote; True at the end of its output (or its exit)."""
        ready, _, _ = select.select([main], [], [], 0.5)
        if not ready:
            return proc.poll() is not None
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the child side closed
            return True
        chunks.append(data)
        return not data

    began = time.monotonic()
    try:
        wait_until(finished, deadline_s, f"{args[0]} to finish", interval=0)
        code = proc.wait(timeout=max(1.0, began + deadline_s - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(main)
    return code, b"".join(chunks).decode(errors="replace")
