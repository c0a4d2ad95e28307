"""Shared fixtures: `ftctl sim` engines as real processes on loopback free ports.

- `sim_worker`: a fresh engine for one test (faults welcome), killed at teardown.
- `sim_worker_factory`: start several (`factory(seed=..., args=[...])`); all killed at teardown.
- `shared_sim_worker`: one engine per test session (xdist: per test process) for
  read-only tests; do not inject faults into it. It keeps the sim's default
  first-request warm-up (1 s), so its first caller meets a slow first request.

Factory workers start without the warm-up (`warmup_s=0`) to keep the suite fast;
pass `warmup_s=...` to a factory to have one.

Each worker has `.url`, `.pid`, `.admin_token` (`SIM_ADMIN_TOKEN`), `.stderr_text()`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

SIM_ADMIN_TOKEN = "sim-test-token"
SimWorkerFactory = Callable[..., "SimWorker"]

_CACHE_HOME = "_FTCTL_TEST_CACHE_HOME"


def pytest_configure(config: pytest.Config) -> None:
    """The parsed-YAML cache of this test process (and its children) lives in a temp dir;
    SIGTERM interrupts the run as Ctrl-C does, so fixtures stop what they started."""
    from tests.reaper import interrupt_on_sigterm

    interrupt_on_sigterm()
    path = tempfile.mkdtemp(prefix="ftctl-cache-")
    os.environ[_CACHE_HOME] = os.environ["XDG_CACHE_HOME"] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove this process's cache dir."""
    path = os.environ.pop(_CACHE_HOME, None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _start(**kwargs: Any) -> SimWorker:
    from dynamo_ftctl.engine.launcher import start_worker

    kwargs.setdefault("admin_token", SIM_ADMIN_TOKEN)
    kwargs.setdefault("timeout_s", 90.0)
    warmup_s = kwargs.pop("warmup_s", 0.0)
    if warmup_s is not None:
        kwargs["args"] = ("--warmup-s", str(warmup_s), *kwargs.get("args", ()))
    return start_worker(**kwargs)


@pytest.fixture
def sim_worker_factory() -> Iterator[SimWorkerFactory]:
    """Start `ftctl sim serve` workers on free ports; every one is stopped at teardown."""
    started: list[SimWorker] = []

    def factory(**kwargs: Any) -> SimWorker:
        worker = _start(**kwargs)
        started.append(worker)
        return worker

    try:
        yield factory
    finally:
        for worker in started:
            worker.stop(timeout_s=3)


@pytest.fixture
def sim_worker(sim_worker_factory: SimWorkerFactory) -> SimWorker:
    """One fresh engine (default config, seed 0) for this test."""
    return sim_worker_factory(name="sim")


@pytest.fixture(scope="session")
def shared_sim_worker() -> Iterator[SimWorker]:
    """One engine shared by the read-only tests of this test process."""
    worker = _start(name="shared", warmup_s=None)
    try:
        yield worker
    finally:
        worker.stop(timeout_s=3)
