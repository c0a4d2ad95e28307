"""Real NVIDIA Dynamo stacks (frontend + mocker) in a network namespace of the test's own.

- `dynamo_py`: the Dynamo venv's python (`make dynamo`), or a skip saying how to build it;
  also a skip where no namespace can be made (no root, no `ip`).
- `model_dir`: the tiny Llama's tokenizer + config.json (the mocker loads no weights).
- `netns`: a fresh namespace, loopback up; deleted at teardown.
- `stacks`: a factory, `stacks(name, port, mockers=1)`, starting a frontend and its mockers in
  `netns`, serving; stopped at teardown.
- `ns_proxy`: a factory starting `ftctl proxy` inside `netns` over [(name, url), ...].

The mocker samples at random (no seed reaches it through the frontend), so what is asserted
is an outcome: a stream completes with all its tokens, a canary set of kind shape passes.

Every test here is marked `dynamo`: `make test` runs them in a pytest run of their own after
the vLLM ones, one at a time. A stack's processes run in their own sessions; teardown stops
them and deletes the namespace, and `pytest_sessionfinish` stops whatever is left (a run cut
by Ctrl-C still tears down its fixtures and ends the session).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.dynamo.stack import (
    MODEL,
    Namespace,
    Proc,
    Stack,
    can_make_namespaces,
    cleanup_all,
    dynamo_python,
    spawn,
    tokenizer_dir,
)
from tests.waiting import wait_until

HERE = Path(__file__).parent
PROXY_START_S = 30.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder `dynamo` (`make test` runs them on their own)."""
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.dynamo)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Whatever a fixture did not stop (an interrupted run): stopped, namespaces deleted."""
    cleanup_all()


@pytest.fixture(scope="session")
def dynamo_py() -> Path:
    """The Dynamo venv's python, or a skip that says how to build it."""
    why = can_make_namespaces()
    if why:
        pytest.skip(f"Dynamo stacks run in a network namespace: {why}")
    python = dynamo_python()
    if not python.exists():
        pytest.skip(f"no Dynamo venv at {python}: run `make dynamo` (or set "
                    "FTCTL_DYNAMO_PYTHON)")
    return python


@pytest.fixture(scope="session")
def model_dir(dynamo_py: Path) -> Path:
    return tokenizer_dir(dynamo_py)


@pytest.fixture
def netns() -> Iterator[Namespace]:
    ns = Namespace.create()
    try:
        yield ns
    finally:
        ns.delete()


StackFactory = Callable[..., Stack]


@pytest.fixture
def stacks(dynamo_py: Path, model_dir: Path, netns: Namespace,
           tmp_path: Path) -> Iterator[StackFactory]:
    started: list[Stack] = []

    def factory(name: str, port: int, mockers: int = 1) -> Stack:
        stack = Stack(netns, name, port, dynamo_py, model_dir, tmp_path / name)
        started.append(stack)  # stopped at teardown even if it never served
        stack.workdir.mkdir(parents=True, exist_ok=True)
        stack.start_frontend()
        for _ in range(mockers):
            stack.add_mocker()
        stack.wait_serving()
        return stack

    try:
        yield factory
    finally:
        for stack in started:
            stack.stop()


def inventory(path: Path, workers: list[tuple[str, str]], tokenizer: Path | None = None,
              **proxy: Any) -> Path:
    """An inventory at `path` naming `workers` (name, url) serving MODEL (with its
    tokenizer directory, for the proxy's counts of text without ids)."""
    extra = {"tokenizer": str(tokenizer)} if tokenizer is not None else {}
    doc: dict[str, Any] = {
        "cluster": path.stem,
        "workers": [{"name": n, "url": u, "model": MODEL, "node": "localhost", **extra}
                    for n, u in workers],
        "canary": {"set": "canary-set.yaml", "timeout_s": 10, "max_retries": 1},
    }
    if proxy:
        doc["proxy"] = {"listen": "127.0.0.1:0", "scrape_interval_s": 0.2, **proxy}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def ns_proxy(netns: Namespace, tmp_path: Path) -> Iterator[Callable[..., tuple[Proc, str]]]:
    """`factory(workers, **proxy settings)`: `ftctl proxy` inside the namespace, and its URL
    (from its log); stopped at teardown."""
    started: list[Proc] = []

    def factory(workers: list[tuple[str, str]], tokenizer: Path | None = None,
                **settings: Any) -> tuple[Proc, str]:
        index = len(started)
        path = inventory(tmp_path / f"proxy-{index}.yaml", workers, tokenizer, **settings)
        proxy = spawn(netns, f"proxy{index}", [
            sys.executable, "-m", "dynamo_ftctl", "-i", str(path), "proxy"],
            tmp_path / f"proxy-{index}.log", {**os.environ, "FTCTL_ADMIN_TOKEN": "t"})
        started.append(proxy)
        return proxy, proxy_url(proxy)

    try:
        yield factory
    finally:
        for proxy in started:
            with contextlib.suppress(Exception):
                proxy.stop()


def proxy_url(proxy: Proc, deadline_s: float = PROXY_START_S) -> str:
    """The URL the proxy prints once it serves (a condition with a deadline)."""
    pattern = re.compile(r"serving \d+ workers on (http://\S+)")

    def log() -> str:
        text = proxy.log_text()
        assert pattern.search(text) or proxy.alive, f"proxy exited:\n{text[-3000:]}"
        return text

    found = pattern.search(wait_until(log, deadline_s, "the proxy's 'serving' line",
                                      accept=pattern.search, interval=0.05))
    assert found is not None
    return found.group(1)
