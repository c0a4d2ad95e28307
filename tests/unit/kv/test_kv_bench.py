"""`ftctl kv bench`: the host kernel it measures, and refusing one that is not there."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner

from dynamo_ftctl.cli.main import app, main
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv import native
from dynamo_ftctl.kv.bench import run_kv_bench

runner = CliRunner()


def small(**kwargs: Any) -> Any:
    return run_kv_bench(blocks=(24,), sweep_chunks=(), repeats=1, **kwargs)


def test_torch_kernel_is_measured_when_asked() -> None:
    """--kernel torch measures torch's kernels and says so, for every pattern."""
    result = small(kernel="torch", patterns=("gather", "random"))
    assert result.kernel == "torch"
    assert [(r.pattern, r.blocks, r.bytes) for r in result.rows] == [
        ("gather", 24, 24 * 4096), ("random", 24, 24 * 4096)]
    assert all(r.ratio > 0 and r.copier_gb_per_s > 0 for r in result.rows)


def test_auto_uses_the_native_kernel_when_it_is_there(monkeypatch: pytest.MonkeyPatch,
                                                      row_kernel: native.RowKernel) -> None:
    """With a built kernel, auto and native measure it; without, auto falls back to torch."""
    monkeypatch.setattr(native, "kernel", lambda: row_kernel)
    assert small(kernel="auto").kernel == "native"
    assert small(kernel="native").kernel == "native"
    monkeypatch.setattr(native, "kernel", lambda: None)
    assert small(kernel="auto").kernel == "torch"


def test_the_chunk_sweep_measures_torchs_kernels(monkeypatch: pytest.MonkeyPatch,
                                                 row_kernel: native.RowKernel) -> None:
    """The rows use the native kernel, the chunk-size sweep torch's staged copy (the only
    one that has chunks)."""
    from dynamo_ftctl.kv import bench

    monkeypatch.setattr(native, "kernel", lambda: row_kernel)
    seen: list[tuple[str, Any]] = []
    real = bench.copy_blocks

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((kwargs["chunk_bytes"], kwargs["native"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "copy_blocks", spy)
    result = run_kv_bench(blocks=(16,), patterns=("random",), sweep_chunks=(8192,),
                          sweep_blocks=16, repeats=1, kernel="native")
    assert result.kernel == "native"
    assert {native_arg for chunk, native_arg in seen if chunk == 8192} == {False}
    assert {native_arg for chunk, native_arg in seen if chunk != 8192} == {True}


def test_native_kernel_that_was_not_built_is_bad_input(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: Any) -> None:
    """--kernel native without a built kernel is exit 2 saying why; unknown kernels too."""
    monkeypatch.setattr(native, "kernel", lambda: None)
    with pytest.raises(InvalidInput, match="row-copy kernel is not available"):
        small(kernel="native")
    assert main(["kv", "bench", "--kernel", "native", "--blocks", "8"]) == 2
    assert "--kernel native: the row-copy kernel is not available" in capsys.readouterr().err
    assert main(["kv", "bench", "--kernel", "simd", "--blocks", "8"]) == 2
    assert "'simd' (choose from auto, native, torch)" in capsys.readouterr().err


def test_cli_json_names_the_kernel() -> None:
    """`ftctl kv bench --kernel torch --json` carries the kernel beside the rows."""
    result = runner.invoke(app, ["kv", "bench", "--kernel", "torch", "--blocks", "16",
                                 "--sweep-kib", "", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["kernel"] == "torch"
    assert [r["pattern"] for r in doc["rows"]] == ["gather", "scatter", "random"]


def test_cold_caches_are_evicted_before_every_timed_run() -> None:
    """--cache cold evicts before each timed run of the copier and of the baseline alike
    (and warm never): the two are measured from the same cache state."""
    calls: list[int] = []
    evict = lambda: calls.append(1)  # noqa: E731 - a counting evictor
    result = run_kv_bench(blocks=(24,), sweep_chunks=(), repeats=3, cache="cold", evict=evict,
                          patterns=("gather", "random"))
    assert result.cache == "cold"
    assert len(calls) == 2 * 2 * 3  # 2 patterns x (copier + baseline) x 3 repeats
    calls.clear()
    assert small(cache="warm", evict=evict).cache == "warm"
    assert calls == []
    with pytest.raises(InvalidInput, match="--cache: 'hot' \\(choose from warm, cold\\)"):
        small(cache="hot")


def test_the_default_evictor_reads_past_the_last_level_cache() -> None:
    """The evictor owns a written buffer twice the last-level cache (not zero pages, which
    all share one physical page and evict nothing)."""
    from dynamo_ftctl.kv.bench import _cache_evictor

    evict = _cache_evictor()
    buffer = next(c.cell_contents for c in evict.__closure__ or () if isinstance(
        c.cell_contents, bytes))
    assert len(buffer) == 2 * (native.last_level_cache_bytes() or 32 << 20)
    assert buffer.count(b"\x02") == len(buffer)
    evict()


def test_cli_cache_mode_reaches_the_result() -> None:
    """`ftctl kv bench --cache cold --json` reports the cold cache state."""
    result = runner.invoke(app, ["kv", "bench", "--kernel", "torch", "--blocks", "16",
                                 "--sweep-kib", "", "--repeats", "1", "--cache", "cold",
                                 "--patterns", "gather", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["cache"] == "cold"


def test_progress_counts_every_measurement_sweep_included() -> None:
    """`on_progress` is called once per measured row, out of rows + sweep points."""
    steps: list[tuple[int, int]] = []
    result = run_kv_bench(blocks=(16, 24), patterns=("random",), sweep_chunks=(8192,),
                          sweep_blocks=16, repeats=1,
                          on_progress=lambda done, total: steps.append((done, total)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert len(result.rows) + len(result.sweep) == 3
