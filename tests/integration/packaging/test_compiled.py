"""The mypyc build of the proxy's hot modules (`FTCTL_MYPYC=1`, `make compiled`,
hatch_build.MYPYC_MODULES): each compiles, imports as an extension, and a proxy run from
the compiled tree relays non-streamed and streamed completions from the loopback target.

The modules are compiled into a copy of src/ in the test's temporary directory (this
checkout is never written); the pure-Python path is what every other test runs. Skipped
where mypyc or a C compiler is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from dynamo_ftctl.http1 import HttpError, Reply
from tests import fetch
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
START_S = 30.0


def _hatch_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_ftctl_hatch_build", ROOT / "hatch_build.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compiled_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of src/ with the compiled extensions beside the modules' `.py` files."""
    if importlib.util.find_spec("mypyc") is None or shutil.which("cc") is None:
        pytest.skip("needs mypyc (the dev extra's mypy) and a C compiler")
    hatch_build = _hatch_build()
    src = tmp_path_factory.mktemp("compiled") / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    built = hatch_build.compile_modules(ROOT, src)
    assert not isinstance(built, str), built
    return src


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def test_every_listed_module_imports_as_an_extension(compiled_src: Path) -> None:
    """Each module of MYPYC_MODULES is loaded from its compiled extension, not its .py."""
    names = [m.removesuffix(".py").replace("/", ".") for m in _hatch_build().MYPYC_MODULES]
    script = ("import importlib, json, sys\n"
              "print(json.dumps({n: importlib.import_module(n).__file__ "
              "for n in sys.argv[1:]}))")
    out = subprocess.run([sys.executable, "-c", script, *names], env=_env(compiled_src),
                         capture_output=True, text=True, check=True, timeout=60)
    files = json.loads(out.stdout)
    assert {n: f.endswith(".so") for n, f in files.items()} == dict.fromkeys(names, True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def compiled_proxy(compiled_src: Path, tmp_path: Path) -> Iterator[str]:
    """`ftctl proxy` from the compiled tree in front of the loopback target; its URL."""
    env = _env(compiled_src)
    target = subprocess.Popen([sys.executable, "-m", "dynamo_ftctl.loadgen.target",
                               "--port", "0"], env=env, stdout=subprocess.PIPE)
    procs = [target]
    try:
        assert target.stdout is not None
        match = re.search(rb":(\d+)\s*$", target.stdout.readline())
        assert match is not None
        port = _free_port()
        inventory = tmp_path / "inv.yaml"
        inventory.write_text(
            f"cluster: c\nworkers:\n  - {{name: w0, url: 'http://127.0.0.1:"
            f"{int(match.group(1))}', model: m}}\nproxy:\n  listen: 127.0.0.1:{port}\n"
            "  whole_max_tokens: 5\n")
        proxy = subprocess.Popen([sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory),
                                  "proxy"], env=env, stdout=subprocess.DEVNULL)
        procs.append(proxy)
        url = f"http://127.0.0.1:{port}"

        def answers() -> Reply:
            assert proxy.poll() is None, f"the proxy exited with {proxy.returncode}"
            return fetch.get(f"{url}/health", timeout=1.0)

        wait_until(answers, START_S, f"{url} answering", accept=lambda r: True,
                   ignore=(HttpError, TimeoutError), interval=0.05)
        yield url
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if target.stdout is not None:
            target.stdout.close()


def test_the_compiled_proxy_relays_plain_and_streamed_completions(compiled_proxy: str) -> None:
    """Through the compiled modules: plain answers of 5 tokens (one whole upstream answer,
    `whole_max_tokens: 5`) and 6 (read from a stream) with their usage, and a stream of 7
    token chunks ending in [DONE]."""
    url = f"{compiled_proxy}/v1/completions"
    for tokens in (5, 6):
        plain = fetch.post(url, json={"model": "m", "prompt": "hi", "max_tokens": tokens},
                           timeout=10)
        assert plain.status == 200, plain.text
        doc = plain.json()
        assert (doc["choices"][0]["text"], doc["choices"][0]["finish_reason"],
                doc["usage"]["completion_tokens"]) == ("x" * tokens, "length", tokens)
    streamed = fetch.post(url, json={"model": "m", "prompt": "hi", "max_tokens": 7,
                                     "stream": True}, timeout=10)
    assert streamed.status == 200, streamed.text
    data = [line[6:] for line in streamed.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    text = "".join(c["text"] for d in data[:-1] for c in json.loads(d)["choices"])
    assert text == "x" * 7


def test_the_proxy_tests_pass_on_the_compiled_build(compiled_src: Path) -> None:
    """tests/unit/proxy, every proxy path with fake workers (failures, hostile input,
    whole answers), run on the compiled modules: mypyc checks each value against its
    annotation at run time, so an annotation that a real value contradicts fails here, not
    only in production."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-x", "-n", "2", "tests/unit/proxy"],
                         cwd=ROOT, env=_env(compiled_src), capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    probe = subprocess.run([sys.executable, "-c", "import dynamo_ftctl.proxy.policy as m; "
                            "print(m.__file__)"], cwd=ROOT, env=_env(compiled_src),
                           capture_output=True, text=True, check=True, timeout=60)
    assert probe.stdout.strip().endswith(".so")  # the run above took the extensions


def _handler_awaits(path: Path) -> list[str]:
    """Where a module awaits (await, async for, async with) inside an except or finally
    block, or reads the exception being handled from `sys` or `logging.exception`."""
    import ast

    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            blocks = [("finally", node.finalbody)] + [("except", h.body) for h in node.handlers]
            for kind, body in blocks:
                for stmt in body:
                    for sub in ast.walk(stmt):
                        if isinstance(sub, ast.Await | ast.AsyncFor | ast.AsyncWith):
                            found.append(f"{path.name}:{sub.lineno}: await in {kind}")
        if isinstance(node, ast.Attribute) and node.attr in {"exception", "exc_info"} \
                and isinstance(node.value, ast.Name) and node.value.id in {"sys", "log"}:
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_compiled_module_awaits_while_an_exception_is_handled() -> None:
    """mypyc's coroutines keep the exception being handled in the thread, not per task: an
    await in an except or finally block (or sys.exception(), log.exception) hands it to
    whatever task runs meanwhile (a fake worker's TypeError came out of the proxy's front
    door). No module of MYPYC_MODULES does either."""
    found = [where for module in _hatch_build().MYPYC_MODULES
             for where in _handler_awaits(ROOT / "src" / module)]
    assert found == []
