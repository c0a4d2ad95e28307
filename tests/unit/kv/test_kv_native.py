"""The native row-copy kernel: building, loading, falling back, and its streaming stores."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dynamo_ftctl.kv import native  # noqa: E402
from dynamo_ftctl.kv.copy import copy_blocks  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def kernel(row_kernel: native.RowKernel) -> native.RowKernel:
    """The kernel built from the shipped source (conftest)."""
    return row_kernel


def rows(count: int, width: int, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, width), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("width", [4096, 80, 1000, 7], ids=["4KiB", "80B", "1000B", "7B"])
@pytest.mark.parametrize("pattern", ["gather", "scatter", "random"])
def test_large_copies_stream_bit_exact(kernel: native.RowKernel, width: int, pattern: str) -> None:
    """Copies past the streaming threshold are exact for aligned rows (streamed, with a
    16-byte tail past the last whole line for 80 B), unaligned strides (1000 B) and odd
    rows (7 B, plain memcpy)."""
    count = native.STREAM_MIN_BYTES // width + 64  # over the threshold
    total = count + count // 3
    src, dst = rows(total, width, 1), rows(total, width, 2)
    gen = torch.Generator().manual_seed(3)
    sids = torch.randperm(total, generator=gen)[:count]
    dids = torch.randperm(total, generator=gen)[:count]
    if pattern == "gather":
        dids = torch.arange(count) + 5
    elif pattern == "scatter":
        sids = torch.arange(count) + 7
    want = dst.clone()
    want[dids] = src[sids]
    handle = copy_blocks([src], [dst], sids, dids, native=kernel)
    assert handle.pieces == 1  # one pass over the layer, no staging
    assert torch.equal(dst, want)


@pytest.mark.parametrize("threads", [2, 3, 100])
def test_threaded_copies_are_exact(kernel: native.RowKernel, threads: int) -> None:
    """Rows split among threads (more threads than the 64 allowed, or than rows, too)
    land exactly once each."""
    count, total = 300, 400
    src, dst = rows(total, 4096, 9), rows(total, 4096, 10)
    gen = torch.Generator().manual_seed(11)
    sids = torch.randperm(total, generator=gen)[:count]
    dids = torch.randperm(total, generator=gen)[:count]
    want = dst.clone()
    want[dids] = src[sids]
    kernel.copy_rows(dst, src, dids, sids, count, threads=threads)
    assert torch.equal(dst, want)
    few_src, few_dst = rows(5, 64, 12), rows(5, 64, 13)
    kernel.copy_rows(few_dst, few_src, 0, 0, 5, threads=threads)
    assert torch.equal(few_dst, few_src)


def test_small_copy_through_the_kernel_is_exact(kernel: native.RowKernel) -> None:
    """Below the streaming threshold the kernel copies with cached stores, exactly."""
    src, dst = rows(50, 4096, 4), rows(50, 4096, 5)
    want = dst.clone()
    want[[40, 3, 17]] = src[[0, 49, 8]]
    kernel.copy_rows(dst, src, torch.tensor([40, 3, 17]), torch.tensor([0, 49, 8]), 3)
    assert torch.equal(dst, want)


@pytest.mark.parametrize(
    ("ids", "want"),
    [([4, 5, 6], 4), ([7], 7), ([1, 5, 9], native.RUN_NONE), ([9, 1, 5], native.RUN_NONE),
     ([3, 1, 3], native.BAD_IDS), ([1, 10], native.BAD_IDS), ([-1, 2], native.BAD_IDS),
     ([2, 2], native.BAD_IDS)],
    ids=["run", "one", "ascending", "unordered", "repeat", "too-high", "negative",
         "repeat-adjacent"],
)
def test_the_kernel_checks_ids(kernel: native.RowKernel, ids: list[int], want: int) -> None:
    """One C pass says run (its first block), distinct, or bad (out of range or repeated)."""
    assert kernel.check_ids(torch.tensor(ids, dtype=torch.long), 10) == want


def test_the_kernel_sorts_id_pairs(kernel: native.RowKernel) -> None:
    """The counting sort orders the key ids and carries the other list along."""
    gen = torch.Generator().manual_seed(8)
    key = torch.randperm(5000, generator=gen)[:3000]
    other = torch.randperm(5000, generator=gen)[:3000]
    pair = kernel.sort_pairs(key, other, 5000)
    assert pair is not None
    order = key.argsort()
    assert torch.equal(pair[0], key[order])
    assert torch.equal(pair[1], other[order])


def test_missing_or_foreign_library_falls_back(tmp_path: Path, capsys: Any) -> None:
    """No library means None silently; a file that is no library warns once and is None."""
    assert native.load(tmp_path / "absent.so") is None
    bogus = tmp_path / "_rowcopy.so"
    bogus.write_bytes(b"not an ELF file")
    assert native.load(bogus) is None
    assert "KV row-copy kernel not used" in capsys.readouterr().err


def test_a_kernel_of_another_abi_is_refused(tmp_path: Path, capsys: Any) -> None:
    """A library left from an older build (another ABI number) is not called."""
    source = tmp_path / "old.c"
    source.write_text(native.SOURCE.read_text().replace(
        f"ftctl_rowcopy_abi(void) {{ return {native.ABI}; }}",
        f"ftctl_rowcopy_abi(void) {{ return {native.ABI + 1}; }}"))
    try:
        path = native.build(tmp_path / "old.so", source=source)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no C compiler: {exc}")
    assert native.load(path) is None
    assert f"kernel ABI {native.ABI + 1}, this package needs {native.ABI}" in \
        capsys.readouterr().err


def test_the_environment_switch_disables_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """FTCTL_KV_NATIVE=0 makes `kernel()` None: copies then use torch's kernels."""
    native.kernel.cache_clear()
    monkeypatch.setenv("FTCTL_KV_NATIVE", "0")
    try:
        assert native.kernel() is None
        src, dst = rows(8, 64, 6), rows(8, 64, 7)
        want = dst.clone()
        want[[1, 6]] = src[[5, 2]]
        handle = copy_blocks([src], [dst], [5, 2], [1, 6], chunk_bytes=64)
        assert handle.pieces == 2  # staged in torch's two passes, one block per chunk
        assert torch.equal(dst, want)
    finally:
        native.kernel.cache_clear()


def test_a_failed_build_raises_with_the_compiler_output(tmp_path: Path) -> None:
    """A source the compiler rejects raises CalledProcessError and leaves no library."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    out = tmp_path / "broken.so"
    with pytest.raises(subprocess.CalledProcessError) as caught:
        native.build(out, source=source)
    assert caught.value.stderr
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [source]  # no partial file left behind


def hook_module() -> Any:
    pytest.importorskip("hatchling", reason="hatchling runs in pip's isolated build env")
    spec = importlib.util.spec_from_file_location("hatch_build", REPO / "hatch_build.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("compiler", ["cc", "false"], ids=["builds", "no-compiler"])
def test_install_hook_ships_the_kernel_or_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiler: str, capsys: Any,
) -> None:
    """The wheel hook ships a built kernel as a platform wheel; when the compiler fails it
    only warns, removes any stale library and leaves a pure wheel (the install goes on)."""
    if compiler == "cc" and shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    hook = hook_module()
    kv = tmp_path / "src/dynamo_ftctl/kv"
    kv.mkdir(parents=True)
    for name in ("native.py", "_rowcopy.c"):
        shutil.copy(REPO / "src/dynamo_ftctl/kv" / name, kv / name)
    (kv / "_rowcopy.so").write_bytes(b"stale")
    monkeypatch.setenv("CC", compiler)
    instance = hook.CustomBuildHook(str(tmp_path), {}, None, None, str(tmp_path), "wheel")
    build_data: dict[str, Any] = {"artifacts": []}
    instance.initialize("0", build_data)
    if compiler == "cc":
        assert build_data == {"artifacts": [hook.LIBRARY], "pure_python": False,
                              "infer_tag": True}
        assert native.load(kv / "_rowcopy.so") is not None
    else:
        assert build_data == {"artifacts": []}
        assert not (kv / "_rowcopy.so").exists()
        assert "KV row-copy kernel not built" in capsys.readouterr().err
