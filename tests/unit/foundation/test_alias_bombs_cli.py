"""Alias bombs handed to real `ftctl` commands: exit 2, one line, bounded time and memory.

Each bomb (`bombs.ALIAS_BOMBS`) goes to the three commands that read user YAML
(`inventory check`, `canary --set`, `drill`), with the parse cache on (in this test's
temp dir) and off. The child runs under a 1 GiB address-space limit and a 5 s
timeout: a loader that expands the aliases anywhere (the cache's msgpack encoding
did, issue 30) dies or is killed, and the test fails.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.foundation.bombs import ALIAS_BOMBS

ADDRESS_SPACE = 1 << 30
# A refusal takes ~0.1 s. The bound that catches an expanding bomb is the address space
# (the expanding cache took 2 GB); the timeout only stops a child that hangs, so it is
# loose enough for a machine at load 10, where the same child once took over 5 s.
TIMEOUT_S = 60.0


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


COMMANDS = {
    "inventory": lambda p, tmp: ["-i", str(p), "inventory", "check"],
    "canary-set": lambda p, tmp: ["canary", "--url", "http://127.0.0.1:9", "--set", str(p),
                                  "--no-state"],
    "drill": lambda p, tmp: ["drill", str(p), "--out", str(tmp / "report"), "--no-plot"],
}


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS.keys())
@pytest.mark.parametrize("bomb", ALIAS_BOMBS, ids=ALIAS_BOMBS.keys())
def test_an_alias_bomb_is_one_line_exit_2_within_bounds(
    tmp_path: Path, bomb: str, command: str, cached: bool,
) -> None:
    """The bomb is refused (exit 2, one line naming file and line) before it is built or
    cached, under 1 GiB of address space and within the timeout."""
    text, words = ALIAS_BOMBS[bomb]
    path = tmp_path / "bomb.yaml"
    path.write_text(text())
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "FTCTL_INVENTORY": ""}
    env.pop("FTCTL_NO_CACHE", None)
    if not cached:
        env["FTCTL_NO_CACHE"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", *COMMANDS[command](path, tmp_path)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
        preexec_fn=_limit_memory,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert re.match(rf"error: {re.escape(str(path))}:\d+: ", done.stderr), done.stderr
    assert words in done.stderr
    assert not list(cache.rglob("*.msgpack"))
    assert not (tmp_path / "report").exists()
