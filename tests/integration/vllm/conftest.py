"""Real vLLM servers (CPU) on loopback, serving a tiny random-weight Llama written offline.

- `tiny_llama`: the model directory, written once per machine by `write_tiny_llama.py`
  (run under the vLLM venv's python) into a cache keyed by a hash of the script and its corpus.
- `vllm_pair`: two servers for the whole session, started together, each in its own
  process group with its OpenMP threads bound to its own core; a test gets them alive (one a
  test before killed is started again on its port) and they are stopped at the end
  (SIGTERM to the group, SIGKILL after a deadline).

Every test here is marked `vllm`: `make test` runs them in a pytest run of their own, one
at a time (each server takes a core; two pairs at once would not fit a 2-core machine), after
the rest of the suite. pytest-xdist's `xdist_group` cannot keep them together: with pytest 9.2
and xdist 3.8 the group never reaches the scheduler.

vLLM lives in its own venv (`make vllm`), found through `$FTCTL_VLLM_PYTHON`; without it
these tests skip. `make test` builds it first, so only a bare `pytest` run skips.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.vllm.server import (
    VllmServer,
    spawn_vllm,
    tiny_llama_dir,
    vllm_python,
    wait_healthy,
)

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def vllm_py() -> Path:
    """The vLLM venv's python, or a skip that says how to build it."""
    python = vllm_python()
    if not python.exists():
        pytest.skip(f"no vLLM venv at {python}: run `make vllm` (or set FTCTL_VLLM_PYTHON)")
    return python


@pytest.fixture(scope="session")
def tiny_llama(vllm_py: Path) -> Path:
    """The tiny Llama's directory, written on first use into ~/.cache/ftctl/models."""
    return tiny_llama_dir(vllm_py)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder `vllm` (`make test` runs them on their own)."""
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)


# The session pair's servers once started: a module that starts servers of its own stops
# these first (at most two servers at once on a 2-core machine); `vllm_pair` starts them
# again for the next test that asks.
SESSION_SERVERS: list[VllmServer] = []


@pytest.fixture
def vllm_pair(vllm_servers: tuple[VllmServer, ...]) -> tuple[VllmServer, ...]:
    """The session's two servers, alive: one that an earlier test killed starts again."""
    for server in vllm_servers:
        if not server.alive:
            server.restart()
    return vllm_servers


@pytest.fixture(scope="session")
def vllm_servers(vllm_py: Path, tiny_llama: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, ...]]:
    """Two vLLM servers for the session, one core each; stopped at its end."""
    logs = tmp_path_factory.mktemp("vllm")
    cpus = sorted(os.sched_getaffinity(0))
    servers: list[VllmServer] = []
    try:
        began = time.monotonic()
        for index in range(2):
            name = f"vllm{index + 1}"
            servers.append(spawn_vllm(vllm_py, tiny_llama, logs / f"{name}.log", name=name,
                                      cpu=cpus[index % len(cpus)]))
        for server in servers:
            wait_healthy(server, began)
        SESSION_SERVERS[:] = servers
        yield tuple(servers)
    finally:
        for server in servers:
            server.stop()
