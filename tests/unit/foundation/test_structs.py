"""The one validation library: every file format is a StrictStruct read by `load_struct`,
and every bad value is one `file:line: key: message` error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
from msgspec import Meta

from dynamo_ftctl.engine.config import EngineConfig, resolve_engine_config
from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.structs import (
    KeyedValueError,
    StrictStruct,
    check_name,
    convert_struct,
    load_struct,
    replace,
    to_data,
)


class _Pair(StrictStruct, frozen=True, kw_only=True):
    """A format with a bound, a checked name and a rule across two fields."""

    name: str
    low: Annotated[int, Meta(ge=0)] = 0
    high: int = 10
    note: str | None = None
    _checked = (("name", check_name),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.high < self.low:
            raise KeyedValueError(("high",), f"must be at least low ({self.low})")


class _Outer(StrictStruct, frozen=True, kw_only=True):
    pairs: tuple[_Pair, ...]


def _write(tmp_path: Path, text: str, name: str = "f.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "where"), [
    ("pairs:\n  - {name: a}\n  - name: b\n    low: -1\n", "f.yaml:4: pairs[1].low: expected"),
    ("pairs:\n  - {name: a}\n  - name: b\n    low: 5\n    high: 2\n",
     "f.yaml:5: pairs[1].high: must be at least low (5)"),
    ("pairs:\n  - {name: 'a b'}\n", "f.yaml:2: pairs[0].name: invalid name 'a b'"),
    ("pairs:\n  - {name: a, hihg: 3}\n", "f.yaml:2: pairs[0].hihg: unknown key; did you mean 'high'?"),
    ("pairs:\n  - {low: 1}\n", "f.yaml:2: pairs[0].name: missing required key"),
    ("- 1\n", "f.yaml:1: expected a mapping at the top level, got a list"),
])
def test_load_struct_errors_name_file_line_and_key(tmp_path: Path, text: str, where: str) -> None:
    """A bound, a check, a cross-field rule, a typo and a missing key: each one line."""
    with pytest.raises(InventoryError) as caught:
        load_struct(_write(tmp_path, text), _Outer)
    assert str(caught.value).startswith(f"{tmp_path}/{where}")
    assert "\n" not in str(caught.value)


def test_load_struct_reads_json_too(tmp_path: Path) -> None:
    """A JSON file is YAML: the same loader reads it, with lines."""
    path = _write(tmp_path, '{"pairs": [\n  {"name": "a"},\n  {"name": "b", "low": "x"}\n]}\n',
                  "f.json")
    assert load_struct(_write(tmp_path, '{"pairs": [{"name": "a"}]}', "g.json"), _Outer).pairs
    with pytest.raises(InventoryError, match=r"f.json:3: pairs\[1\].low: expected an integer"):
        load_struct(path, _Outer)


def test_to_data_and_replace() -> None:
    """to_data gives plain data (lists, no None with exclude_none) that converts back;
    replace changes a field without re-validating."""
    outer = convert_struct({"pairs": [{"name": "a", "note": None}]}, _Outer)
    assert to_data(outer) == {"pairs": [{"name": "a", "low": 0, "high": 10, "note": None}]}
    assert to_data(outer, exclude_none=True) == {"pairs": [{"name": "a", "low": 0, "high": 10}]}
    assert convert_struct(to_data(outer), _Outer) == outer
    assert replace(outer.pairs[0], low=3).low == 3


def test_engine_config_file_errors_name_the_key(tmp_path: Path) -> None:
    """An engine config's cross-field rule names its key and line; an override names the key."""
    path = _write(tmp_path, "d_model: 64\nn_heads: 3\nn_kv_heads: 2\n", "e.yaml")
    with pytest.raises(InventoryError) as caught:
        resolve_engine_config(str(path))
    assert "e.yaml:2: n_heads: n_heads (3) must be a multiple" in str(caught.value)
    with pytest.raises(InvalidInput, match=r"^engine config: max_model_len: expected"):
        resolve_engine_config("ftctl-sim-tiny", max_model_len=4)
    assert resolve_engine_config("ftctl-sim-tiny", num_blocks=8) == replace(
        EngineConfig(), num_blocks=8)


def test_loading_every_file_format_imports_no_pydantic(tmp_path: Path) -> None:
    """Scenarios, engine configs, calibrations, canary sets and prompt files load without
    pydantic (start-up budget: msgspec validates in ~10 ms where pydantic costs ~120 ms)."""
    code = (
        "import sys\n"
        "import dynamo_ftctl.drill.scenario, dynamo_ftctl.engine.config\n"
        "import dynamo_ftctl.migrate.calibrate, dynamo_ftctl.health.canaryset\n"
        "import dynamo_ftctl.loadgen.workload, dynamo_ftctl.inventory\n"
        "print('pydantic' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "False"
