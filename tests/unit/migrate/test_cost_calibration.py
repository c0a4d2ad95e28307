"""Calibration fitting, the calibration file, and `ftctl migrate plan` / `ftctl kv` on the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynamo_ftctl.cli.main import app, main
from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.migrate.calibrate import (
    Calibration,
    PlanOverrides,
    PrefillFit,
    Sample,
    TransferFit,
    fit_prefill,
    fit_transfer,
    load_calibration,
    parse_lengths,
    plan_from_options,
    save_calibration,
)
from dynamo_ftctl.migrate.cost import MigrationPlan, PlanTable

runner = CliRunner()


def test_fit_prefill_recovers_a_quadratic() -> None:
    """Exact samples of f + l·n + q·n² give back f, l and q."""
    f, lin, quad = 0.004, 2e-5, 3e-9
    samples = [Sample(tokens=n, seconds=f + lin * n + quad * n * n) for n in (16, 128, 512, 2000)]
    fit = fit_prefill(samples)
    assert fit.fixed_s == pytest.approx(f, rel=1e-6)
    assert fit.per_token_s == pytest.approx(lin, rel=1e-6)
    assert fit.per_token2_s == pytest.approx(quad, rel=1e-6)


def test_fit_prefill_never_goes_negative() -> None:
    """Noisy, concave samples fit with every term >= 0 (a negative rate is not a rate)."""
    samples = [Sample(tokens=n, seconds=s) for n, s in ((10, 0.010), (100, 0.030), (1000, 0.040))]
    fit = fit_prefill(samples)
    assert min(fit.fixed_s, fit.per_token_s, fit.per_token2_s) >= 0
    with pytest.raises(InvalidInput, match="does not grow"):
        fit_prefill([Sample(tokens=n, seconds=0.01) for n in (10, 100, 1000)])


def test_fit_transfer_gives_setup_and_bandwidth() -> None:
    """A linear move time gives back its setup and bytes-per-token over seconds-per-token."""
    samples = [Sample(tokens=n, seconds=0.01 + n * 1e-6) for n in (100, 1000, 2000)]
    fit = fit_transfer(samples, kv_bytes_per_token=1024)
    assert fit.setup_s == pytest.approx(0.01)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1024 / 1e-6)


def _cal() -> Calibration:
    return Calibration(
        worker="w1", peer="w2", model="ftctl-sim-tiny", layers=2, kv_heads=2, head_dim=32,
        dtype_bytes=4, block_size=16,
        prefill=PrefillFit(fixed_s=0.005, per_token_s=5e-5, per_token2_s=1e-7),
        transfer=TransferFit(setup_s=0.02, bandwidth_bytes_per_s=2e8),
    )


def test_calibration_crossover_matches_its_curves() -> None:
    """At the calibration's crossover the measured KV move and re-prefill cost the same."""
    cal = _cal()
    (n,) = cal.crossovers()
    transfer = cal.transfer.setup_s + n * cal.kv_bytes_per_token / cal.transfer.bandwidth_bytes_per_s
    assert cal.prefill_model().time(n) == pytest.approx(transfer)
    assert cal.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4


def test_calibration_file_round_trips_and_errors_name_the_line(tmp_path: Path) -> None:
    """A saved calibration loads back equal; a bad value is reported with file:line: key."""
    path = tmp_path / "cal.json"
    save_calibration(_cal(), path)
    assert load_calibration(path) == _cal()
    doc = json.loads(path.read_text())
    doc["transfer"]["bandwidth_bytes_per_s"] = 0
    path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(InventoryError) as info:
        load_calibration(path)
    assert info.value.key == "transfer.bandwidth_bytes_per_s"
    assert info.value.line is not None
    assert info.value.line > 1


def test_plan_from_options_uses_calibration_and_overrides(tmp_path: Path) -> None:
    """A calibration replaces geometry, prefill and link; --bandwidth still wins."""
    path = tmp_path / "cal.json"
    save_calibration(_cal(), path)
    plan = plan_from_options(PlanOverrides(tokens=1000, calibration=path))
    assert isinstance(plan, MigrationPlan)
    assert plan.kv_bytes_per_token == 1024
    assert plan.reprefill_s == pytest.approx(0.005 + 1000 * 5e-5 + 1e6 * 1e-7)
    assert plan.transfer_s == pytest.approx(0.02 + 1000 * 1024 / 2e8)
    faster = plan_from_options(PlanOverrides(tokens=1000, calibration=path,
                                             bandwidth_gb_per_s=1.0))
    assert isinstance(faster, MigrationPlan)
    assert faster.transfer_s == pytest.approx(0.02 + 1000 * 1024 / 1e9)
    table = plan_from_options(PlanOverrides(model="llama-3-8b", table=True))
    assert isinstance(table, PlanTable)
    assert len(table.plans) == len(table.contexts) * 8


def test_parse_lengths() -> None:
    """Lengths are sorted, deduplicated, and at least three."""
    assert parse_lengths("256, 16,64,16") == (16, 64, 256)
    with pytest.raises(InvalidInput, match="at least three"):
        parse_lengths("16,32")
    with pytest.raises(InvalidInput, match="integers"):
        parse_lengths("a,b,c")


def test_cli_plan_json_has_integer_byte_counts() -> None:
    """`ftctl migrate plan --json` prints the 70B numbers as plain integers."""
    result = runner.invoke(app, ["migrate", "plan", "--model", "llama-3-70b", "--tp", "8",
                                 "--tokens", "32768", "--link", "nvlink4", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["kv_bytes_per_token"] == 327680
    assert doc["kv_bytes_per_token_per_shard"] == 40960
    assert doc["block_bytes_per_shard"] == 655360
    assert doc["kv_bytes_total"] == 32768 * 327680
    assert doc["decision"] == "kv"
    assert math.isclose(doc["transfer_s"], 1e-4 + 32768 * 40960 / 450e9)


def test_cli_plan_table_and_bad_flags() -> None:
    """--table renders contexts × links; an unknown link exits 2 naming the presets."""
    result = runner.invoke(app, ["migrate", "plan", "--tp", "8", "--table"],
                           env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    assert "nvlink4" in result.output
    assert "131072" in result.output
    assert main(["migrate", "plan", "--link", "nvlink9"]) == 2
    assert main(["migrate", "plan", "--tp", "3"]) == 2


def test_cli_kv_bench_json_small() -> None:
    """`ftctl kv bench --json` reports a ratio per id pattern and block count, and per swept
    chunk size (of the random pattern)."""
    pytest.importorskip("torch")
    result = runner.invoke(app, ["kv", "bench", "--blocks", "64,128", "--sweep-kib", "8,64",
                                 "--sweep-blocks", "64", "--repeats", "1",
                                 "--patterns", "gather,random", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [(r["pattern"], r["blocks"]) for r in doc["rows"]] == [
        ("gather", 64), ("gather", 128), ("random", 64), ("random", 128)]
    assert [(r["pattern"], r["chunk_bytes"]) for r in doc["sweep"]] == [
        ("random", 8192), ("random", 65536)]
    assert all(r["ratio"] > 0 and r["bytes"] == r["blocks"] * 4096 for r in doc["rows"])


def test_cli_kv_bench_cuda_without_a_device_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    """`ftctl kv bench --device cuda` on a machine without CUDA exits 3 naming the cause."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: nothing to refuse")
    assert main(["kv", "bench", "--device", "cuda", "--blocks", "8"]) == 3
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_cli_kv_bench_unknown_pattern_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown --patterns value is bad input (exit 2) listing the known ones."""
    pytest.importorskip("torch")
    assert main(["kv", "bench", "--patterns", "gather,zigzag", "--blocks", "8"]) == 2
    assert "zigzag (choose from gather, scatter, random)" in capsys.readouterr().err


def test_cli_kv_bench_flash_layout() -> None:
    """`--layout flash` benchmarks caches with blocks on dim 1 ([2, num_blocks, ...])."""
    pytest.importorskip("torch")
    result = runner.invoke(app, ["kv", "bench", "--layout", "flash", "--blocks", "32",
                                 "--sweep-kib", "", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["layout"] == "flash"
    assert [r["pattern"] for r in doc["rows"]] == ["gather", "scatter", "random"]
    assert all(r["ratio"] > 0 and r["bytes"] == 32 * 4096 for r in doc["rows"])
    assert main(["kv", "bench", "--layout", "paged", "--blocks", "8"]) == 2
