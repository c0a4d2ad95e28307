"""Every import contract in pyproject.toml can break: a planted import makes it BROKEN.

Each case copies the package to a temporary directory, adds one import that the
contract forbids (in a new module or at the end of an existing one) and runs
`lint-imports` on the copy with only that contract; the untouched copy keeps them all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "src" / "dynamo_ftctl"
CONFIG = ROOT / "pyproject.toml"

# (contract id, file under dynamo_ftctl/, the planted line)
PLANTED = [
    ("layers", "kv/_planted.py", "import dynamo_ftctl.proxy.policy"),  # upwards
    ("layers", "proxy/_planted.py", "import dynamo_ftctl.gpu.report"),  # independent siblings
    ("layers", "discovery.py", "import dynamo_ftctl.capabilities"),
    ("kernel", "errors.py", "import dynamo_ftctl.output"),
    ("kernel", "output.py", "import dynamo_ftctl.process"),
    ("net", "sse.py", "import dynamo_ftctl.httpserver"),
    ("net", "openai.py", "import dynamo_ftctl.httpapp"),
    ("model", "structs.py", "import dynamo_ftctl.faultnames"),
    ("model", "yamlcache.py", "import dynamo_ftctl.metrics"),
    ("model", "faultnames.py", "import dynamo_ftctl.inventory.lock"),  # a section counts
    ("inventory", "inventory/canary.py", "import dynamo_ftctl.inventory.proxy"),  # siblings
    ("inventory", "inventory/launch.py", "import dynamo_ftctl.inventory.workers"),  # upwards
    ("inventory", "inventory/proxy.py", "import dynamo_ftctl.inventory._file"),  # upwards
    ("inventory", "inventory/_planted.py", "import dynamo_ftctl.structs"),  # not placed
    ("foundation", "metrics.py", "import dynamo_ftctl.health.errors"),
    ("foundation", "inventory/proxy.py", "import dynamo_ftctl.proxy.policy"),
    ("drill", "drill/_planted.py", "import dynamo_ftctl.proxy.fleet"),  # not admission
    ("vllm_connector", "vllm_connector/_planted.py", "import dynamo_ftctl.lock.flock"),
    ("proxy", "proxy/_planted.py", "import dynamo_ftctl.kv.wire"),
    ("gpu", "gpu/_planted.py", "import dynamo_ftctl.health.probe"),
    ("faults", "faults/_planted.py", "import dynamo_ftctl.engine.scheduler"),
    ("health", "health/_planted.py", "import dynamo_ftctl.lock"),
    ("migrate", "migrate/_planted.py", "import dynamo_ftctl.loadgen"),
    ("engine", "engine/_planted.py", "import dynamo_ftctl.lock"),
    ("leaf-services", "kv/_planted.py", "import dynamo_ftctl.migrate"),
    ("leaf-services", "loadgen/_planted.py", "import dynamo_ftctl.engine"),
    ("acyclic", "kv/layout.py", "import dynamo_ftctl.kv.bench"),  # bench imports layout
]


def _copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "dynamo_ftctl",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    return src


def _lint(src: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    selected = [arg for contract in contracts for arg in ("--contract", contract)]
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--config", str(CONFIG), "--no-cache", *selected],
        cwd=src.parent, env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_the_package_keeps_every_contract(tmp_path: Path) -> None:
    result = _lint(_copy(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("contract", "where", "line"), PLANTED,
                         ids=[f"{c}:{w}" for c, w, _ in PLANTED])
def test_a_planted_import_breaks_the_contract(tmp_path: Path, contract: str, where: str,
                                              line: str) -> None:
    src = _copy(tmp_path)
    with (src / "dynamo_ftctl" / where).open("a", encoding="utf-8") as module:
        module.write(f"\n{line}\n")
    result = _lint(src, contract)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 1 broken" in result.stdout, result.stdout
