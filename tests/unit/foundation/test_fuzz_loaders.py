"""Fuzz: random bytes, YAML text and structures at every file loader give a clean result.

Each loader either returns or raises an `FtctlError` whose message is one line; any
other exception (RecursionError, TypeError, UnicodeEncodeError...) is a bug. Inputs
are at most a few KiB, and each example must finish within hypothesis's deadline,
alias bombs of random shape included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_ftctl.documents import parse_json
from dynamo_ftctl.errors import FtctlError
from dynamo_ftctl.faults.audit import read_audit
from dynamo_ftctl.faults.inject import pending_reverts
from dynamo_ftctl.gpu.fake import load_fake_nvml
from dynamo_ftctl.health.baseline import BaselineStore
from dynamo_ftctl.inventory import parse_inventory
from dynamo_ftctl.loadgen.compare import load_report_json
from dynamo_ftctl.loadgen.workload import load_prompts
from dynamo_ftctl.lock.flock import read_owner
from tests.unit.foundation.loaders import YAML_LOADERS as FILE_YAML_LOADERS

ROOT = Path(__file__).resolve().parents[3]

FUZZ = settings(
    max_examples=60, deadline=timedelta(seconds=3), derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)

# ----------------------------------------------------------------- the loaders


def _reverts(path: Path) -> object:
    folder = path.parent / "state"
    (folder / "reverts").mkdir(parents=True, exist_ok=True)
    (folder / "reverts" / "r.json").write_bytes(path.read_bytes())
    return pending_reverts(folder)


YAML_LOADERS: dict[str, Callable[[Path], object]] = {
    **FILE_YAML_LOADERS,
    "inventory-text": lambda p: parse_inventory(p.read_bytes().decode("utf-8", "replace"), p),
    # The same loader, grafted into a shape set below (its own keys and rules).
    "canary-shape-set": FILE_YAML_LOADERS["canary-set"],
}
JSON_LOADERS: dict[str, Callable[[Path], object]] = {
    "load-report": load_report_json,
    "prompt-file": lambda p: load_prompts(p, trace=False),
    "trace": lambda p: load_prompts(p, trace=True),
    "fake-nvml": load_fake_nvml,
    "audit-log": read_audit,
    "canary-state": lambda p: BaselineStore(p).load(),
    "revert-records": _reverts,
    "lock-owner": read_owner,
    "json": lambda p: parse_json(p.read_bytes(), p),
}
LOADERS = {**YAML_LOADERS, **JSON_LOADERS}


def load_cleanly(loader: Callable[[Path], object], path: Path, data: bytes) -> None:
    """Write `data` to `path` and load it: a result, or an FtctlError of one line."""
    path.write_bytes(data)
    try:
        loader(path)
    except FtctlError as exc:
        message = str(exc)
        assert message
        assert "\n" not in message, message


# ------------------------------------------------------------------ strategies

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
_structures = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(
            ["cluster", "workers", "name", "url", "model", "prompts", "prompt", "messages",
             "gpus", "script", "set", "xids", "kind", "method", "timeline", "inventory",
             "expected_token_ids", "ema_s", "samples", "worker", "peer", "transfer"])),
            inner, max_size=5),
    ),
    max_leaves=40,
)
_YAML_TOKENS = [
    "a", "k", "w1", "1", "-1", "0x1F", "1e3", ".inf", ".nan", "~", "null", "true", "no",
    ":", ": ", "- ", "-", "? ", ",", "[", "]", "{", "}", "\n", "  ", "    ", "\t", "#",
    "&a ", "&b ", "*a", "*b", "<<: ", "!!str ", "!!binary ", "!!set ", "!!timestamp ",
    "!!python/object:os.system ", "!foo ", "|", ">", "---\n", "...\n", "%YAML 1.2\n",
    "%TAG ! tag:x,2000:\n", "'", '"', "\\", "\\u00e9", "\u00e9", "\x85", "\ufeff", "@", "`",
    "cluster: ", "workers:\n", "name: ", "url: http://127.0.0.1:1", "model: ", "prompts:\n",
]
_yaml_text = st.lists(st.sampled_from(_YAML_TOKENS), max_size=120).map("".join)


@st.composite
def alias_bombs(draw: st.DrawFn) -> str:
    """Nested anchors of random depth and width, under a random key of a mapping."""
    levels = draw(st.integers(1, 12))
    width = draw(st.integers(1, 12))
    flow_map = draw(st.booleans())
    lines = ["x0: &x0 [lol]"]
    for level in range(1, levels + 1):
        if flow_map:
            items = ", ".join(f"k{i}: *x{level - 1}" for i in range(width))
            lines.append(f"x{level}: &x{level} {{{items}}}")
        else:
            lines.append(f"x{level}: &x{level} [{', '.join([f'*x{level - 1}'] * width)}]")
    key = draw(st.sampled_from(["cluster", "workers", "prompts", "model", "junk"]))
    lines.append(f"{key}: *x{levels}")
    return "\n".join(lines) + "\n"


def _graft(base: Any, value: object, choice: int) -> Any:
    """`base` with the `choice`-th node (in a walk of it) replaced by `value`."""
    nodes: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for key, child in items:
            nodes.append((node, key))
            walk(child)

    walk(base)
    if not nodes:
        return value
    parent, key = nodes[choice % len(nodes)]
    parent[key] = value
    return base


def _bases() -> dict[str, tuple[str, Any]]:
    """A valid document per YAML loader, to graft random structures into."""
    scenario = yaml.safe_load((ROOT / "drills" / "worker-crash.yaml").read_text())
    scenario["inventory"] = str(ROOT / "drills" / "local.yaml")
    return {
        "inventory": ("yaml", yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())),
        "canary-set": ("yaml", yaml.safe_load(
            (ROOT / "canaries" / "ftctl-sim-tiny.yaml").read_text())),
        "canary-shape-set": ("yaml", {
            "kind": "shape", "model": "m", "latency_tolerance": 4.0, "samples": 5,
            "prompts": [{"name": "a", "prompt": "hi", "max_tokens": 8,
                         "finish_reasons": ["length", "stop"], "token_count": [2, 8],
                         "ttft_s": 0.05, "total_s": 0.2}]}),
        "scenario": ("yaml", scenario),
        "engine-config": ("yaml", {"name": "m", "n_layers": 2, "num_blocks": 24}),
        "calibration": ("json", {
            "worker": "a", "peer": "b", "model": "m", "layers": 2, "kv_heads": 2,
            "head_dim": 32, "dtype_bytes": 4, "block_size": 16,
            "prefill": {"fixed_s": 0.0, "per_token_s": 1e-3},
            "transfer": {"setup_s": 1e-4, "bandwidth_bytes_per_s": 1e9}}),
        "load-report": ("json", {"kind": "ftctl-load-report", "completed": 3, "failed": 0,
                                 "ttft_ms": {"p50": 1.0, "p99": 2.0}}),
        "fake-nvml": ("json", {"gpus": 2, "script": [
            {"set": {"1": {"ecc_volatile_uncorrected": 1}}, "xids": [[1, 48]]}]}),
        "canary-state": ("json", {"version": 1, "workers": {"w1": {"ema_s": 0.1,
                                                                   "samples": 3}}}),
    }


BASES = _bases()


def _dump(kind: str, doc: object) -> bytes:
    if kind == "json":
        return json.dumps(doc, allow_nan=True).encode()
    return yaml.safe_dump(doc, allow_unicode=True).encode("utf-8", "surrogatepass")


# ------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", LOADERS)
@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes(tmp_path: Path, name: str, data: bytes) -> None:
    """Any bytes at any loader: loaded, or one clean error line."""
    load_cleanly(LOADERS[name], tmp_path / "in.yaml", data)


@pytest.mark.parametrize("name", LOADERS)
@FUZZ
@given(text=_yaml_text)
def test_random_yaml_text(tmp_path: Path, name: str, text: str) -> None:
    """Token soup of YAML syntax (anchors, tags, directives, flow and block) is clean."""
    load_cleanly(LOADERS[name], tmp_path / "in.yaml", text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("name", LOADERS)
@FUZZ
@given(doc=_structures, as_json=st.booleans())
def test_random_structures(tmp_path: Path, name: str, doc: object, as_json: bool) -> None:
    """Random documents (huge ints, NaN, odd keys, any nesting) as YAML or JSON are clean."""
    data = _dump("json" if as_json else "yaml", doc)
    load_cleanly(LOADERS[name], tmp_path / "in.yaml", data)


@pytest.mark.parametrize("name", BASES)
@FUZZ
@given(value=_structures, choice=st.integers(0, 10_000))
def test_random_structures_in_valid_documents(
    tmp_path: Path, name: str, value: object, choice: int,
) -> None:
    """A valid document with one node replaced by a random structure stays clean."""
    kind, base = BASES[name]
    doc = _graft(json.loads(json.dumps(base)), value, choice)
    load_cleanly(LOADERS[name], tmp_path / "in.yaml", _dump(kind, doc))


@pytest.mark.parametrize("name", YAML_LOADERS)
@FUZZ
@given(text=alias_bombs())
def test_random_alias_bombs(tmp_path: Path, name: str, text: str) -> None:
    """Nested aliases of any shape: clean, and in bounded time (well inside the deadline).
    CPU time, not the wall clock: a starved machine must not fail the bound."""
    started = time.process_time()
    load_cleanly(YAML_LOADERS[name], tmp_path / "in.yaml", text.encode())
    assert time.process_time() - started < 2.0


@FUZZ
@given(lines=st.lists(st.one_of(_structures, st.builds(
    lambda p, t: {"prompt": p, "timestamp": t}, st.text(max_size=8),
    st.floats(allow_nan=True))), max_size=8))
def test_random_prompt_lines(tmp_path: Path, lines: list[object]) -> None:
    """JSON lines of random values, some prompt-shaped, as a prompt file and a trace."""
    data = "\n".join(json.dumps(line, allow_nan=True) for line in lines).encode()
    for name in ("prompt-file", "trace", "audit-log"):
        load_cleanly(LOADERS[name], tmp_path / "in.jsonl", data)

