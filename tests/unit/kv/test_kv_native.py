"""The native row-copy kernel: building, loading, falling back, and its streaming stores."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until

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


def pattern_ids(pattern: str, count: int, total: int, seed: int) -> tuple[Any, Any]:
    """`count` source and destination ids in a cache of `total` rows: random, or one side
    a run (gather: into one, scatter: out of one), or random but ascending sources."""
    gen = torch.Generator().manual_seed(seed)
    sids = torch.randperm(total, generator=gen)[:count]
    dids = torch.randperm(total, generator=gen)[:count]
    if pattern == "gather":
        dids = torch.arange(count) + 5
    elif pattern == "scatter":
        sids = torch.arange(count) + 7
    elif pattern == "ascending":
        sids = sids.sort().values
    return sids, dids


@pytest.mark.parametrize("width", [4096, 80, 1000, 7], ids=["4KiB", "80B", "1000B", "7B"])
@pytest.mark.parametrize("pattern", ["gather", "scatter", "random"])
def test_large_copies_stream_bit_exact(kernel: native.RowKernel, width: int, pattern: str) -> None:
    """Copies past the streaming threshold are exact for aligned rows (streamed, with a
    16-byte tail past the last whole line for 80 B), unaligned strides (1000 B) and odd
    rows (7 B, plain memcpy)."""
    count = native.STREAM_MIN_BYTES // width + 64  # over the threshold
    total = count + count // 3
    src, dst = rows(total, width, 1), rows(total, width, 2)
    sids, dids = pattern_ids(pattern, count, total, seed=3)
    want = dst.clone()
    want[dids] = src[sids]
    handle = copy_blocks([src], [dst], sids, dids, native=kernel)
    assert handle.pieces == 1  # one pass over the layer, no staging
    assert torch.equal(dst, want)


@pytest.fixture(params=["openmp", "pool"])
def team_kernel(
    request: pytest.FixtureRequest, row_kernel: native.RowKernel, pool_kernel: native.RowKernel,
) -> native.RowKernel:
    """The kernel sharing rows on torch's OpenMP team (where torch has one), then on its own
    pool."""
    return row_kernel if request.param == "openmp" else pool_kernel


def random_copy(count: int, width: int, seed: int) -> tuple[Any, Any, Any, Any, Any]:
    """Source and destination rows, random distinct ids on both sides, and the expected
    destination after the copy."""
    total = count + count // 3
    src, dst = rows(total, width, seed), rows(total, width, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    sids = torch.randperm(total, generator=gen)[:count]
    dids = torch.randperm(total, generator=gen)[:count]
    want = dst.clone()
    want[dids] = src[sids]
    return src, dst, sids, dids, want


def test_the_kernel_shares_rows_on_torchs_openmp_team(row_kernel: native.RowKernel) -> None:
    """Where torch runs its intra-op work on OpenMP, the kernel uses that team."""
    openmp = torch._C.has_openmp
    assert row_kernel.team == ("openmp" if openmp else "pool")


@pytest.mark.parametrize("threads", [2, 3, 100])
def test_threaded_copies_are_exact(team_kernel: native.RowKernel, threads: int) -> None:
    """Rows shared among threads (more threads than the 64 allowed, or than pieces, too)
    land exactly once each; a copy of one piece stays on the caller's thread."""
    src, dst, sids, dids, want = random_copy(300, 4096, 9)  # 1.2 MiB: 5 pieces
    assert whole_copy(team_kernel, [dst], [src], dids, sids, threads=threads) == 0
    assert torch.equal(dst, want)
    few_src, few_dst = rows(5, 64, 12), rows(5, 64, 13)
    run = torch.arange(5)
    assert whole_copy(team_kernel, [few_dst], [few_src], run, run, threads=threads) == 0
    assert torch.equal(few_dst, few_src)


def test_many_calls_at_changing_thread_counts_are_exact(team_kernel: native.RowKernel) -> None:
    """Hundreds of threaded calls in a row, the thread count changing between them (the
    pool starts more workers, or leaves some idle), copy every row exactly."""
    src, dst, sids, dids, want = random_copy(2000, 1024, 20)  # 2 MiB: 8 pieces
    counts = [2, 4, 1, 3, 8, 2]
    for call in range(300):
        dst_copy = dst.clone()
        whole_copy(team_kernel, [dst_copy], [src], dids, sids, threads=counts[call % 6])
        assert torch.equal(dst_copy, want), f"call {call}"


def test_concurrent_callers_are_exact(team_kernel: native.RowKernel) -> None:
    """Python threads copying at once (ctypes releases the GIL) each get exact copies: on
    the pool one call owns the workers and the others copy on their own threads."""
    cases = [random_copy(1500, 2048, 40 + 10 * k) for k in range(4)]
    failures: list[str] = []

    def copy_many(k: int) -> None:
        src, dst, sids, dids, want = cases[k]
        for call in range(40):
            out = dst.clone()
            whole_copy(team_kernel, [out], [src], dids, sids, threads=2 + k % 2)
            if not torch.equal(out, want):
                failures.append(f"thread {k} call {call}")

    threads = [threading.Thread(target=copy_many, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_copies_on_threads_of_its_own(team_kernel: native.RowKernel) -> None:
    """After threaded copies started the team or pool, a child of fork() still copies on
    two threads, exactly, and exits: fork copies no worker, and the kernel starts its
    own pool there instead of waiting on threads that do not exist."""
    src, dst, sids, dids, want = random_copy(1200, 4096, 60)  # 4.7 MiB: 19 pieces
    whole_copy(team_kernel, [dst.clone()], [src], dids, sids)
    pid = os.fork()
    if pid == 0:  # the child: torch's own OpenMP team cannot run here, so torch on 1 thread
        code = 1
        try:
            torch.set_num_threads(1)
            for _ in range(3):
                out = dst.clone()
                whole_copy(team_kernel, [out], [src], dids, sids)
                if not torch.equal(out, want):
                    break
            else:
                code = 0
        finally:
            os._exit(code)
    try:
        done = wait_until(lambda: os.waitpid(pid, os.WNOHANG), 60,
                          "the forked child's copies (a deadlock if not)",
                          accept=lambda done: done[0] != 0, interval=0.05)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the child's copies were not exact"


def test_small_copy_through_the_kernel_is_exact(kernel: native.RowKernel) -> None:
    """Below the streaming threshold the kernel copies with cached stores, exactly."""
    src, dst = rows(50, 4096, 4), rows(50, 4096, 5)
    want = dst.clone()
    want[[40, 3, 17]] = src[[0, 49, 8]]
    assert whole_copy(kernel, [dst], [src], torch.tensor([40, 3, 17]),
                      torch.tensor([0, 49, 8])) == 0
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


def whole_copy(kernel: native.RowKernel, dst: list[Any], src: list[Any], dids: Any,
               sids: Any, *, threads: int = 2) -> int:
    """`RowKernel.copy_blocks` over 2-D byte-row layers."""
    at = [t.data_ptr() for t in dst] + [t.data_ptr() for t in src] \
        + [t.stride(0) for t in dst] + [t.stride(0) for t in src]
    return kernel.copy_blocks(at, dids, sids, dst_blocks=dst[0].shape[0],
                              src_blocks=src[0].shape[0], row_bytes=src[0].shape[1],
                              threads=threads)


@pytest.mark.parametrize("total", [3000, 100_000], ids=["counting-sort", "qsort"])
@pytest.mark.parametrize("pattern", ["gather", "scatter", "random", "ascending"])
def test_one_call_copies_every_layer_in_any_order(kernel: native.RowKernel, total: int,
                                                  pattern: str) -> None:
    """The whole copy (ids checked, rows ordered, every layer) is exact for each id
    pattern, with ids dense in the cache (counting sort) or sparse (qsort), streamed."""
    sids, dids = pattern_ids(pattern, native.STREAM_MIN_BYTES // 512 + 100, total, seed=8)
    src = [rows(total, 512, seed) for seed in (1, 2)]
    dst = [rows(total, 512, seed) for seed in (3, 4)]
    want = [d.clone() for d in dst]
    for w, s in zip(want, src, strict=True):
        w[dids] = s[sids]
    assert whole_copy(kernel, dst, src, dids, sids) == 0
    assert all(torch.equal(d, w) for d, w in zip(dst, want, strict=True))


@pytest.mark.parametrize(("dids", "sids"), [([1, 2, 2], [0, 1, 2]), ([0, 1, 2], [5, 1, 50]),
                                            ([0, -1, 2], [0, 1, 2])],
                         ids=["repeated", "too-high", "negative"])
def test_one_call_refuses_bad_ids_before_copying(kernel: native.RowKernel, dids: list[int],
                                                 sids: list[int]) -> None:
    """A bad id on either side is BAD_IDS, and not one row has been written."""
    src, dst = [rows(50, 64, 1)], [rows(50, 64, 2)]
    before = dst[0].clone()
    status = whole_copy(kernel, dst, src, torch.tensor(dids), torch.tensor(sids))
    assert status == native.BAD_IDS
    assert torch.equal(dst[0], before)


def test_the_last_level_cache_is_the_largest_sysfs_lists(tmp_path: Path) -> None:
    """The largest cache of sysfs's index*/size entries (K/M suffixes or plain bytes);
    None where there are none."""
    for index, size in (("index0", "32K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(f"{size}\n")
    assert native.last_level_cache_bytes(tmp_path) == 32 << 20
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("67108864\n")
    assert native.last_level_cache_bytes(tmp_path) == 64 << 20
    assert native.last_level_cache_bytes(tmp_path / "absent") is None


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


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


@pytest.mark.parametrize("compiler", ["cc", "false"], ids=["builds", "no-compiler"])
def test_install_hook_ships_the_kernel_or_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiler: str, capsys: Any,
) -> None:
    """The wheel hook compiles the kernel in a directory of its own, ships it through
    force_include as a py3-none-<platform> wheel and removes that directory at finalize;
    when the compiler fails it only warns and leaves a pure wheel. Either way the source
    tree is left as it was."""
    if compiler == "cc" and shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    hook = hook_module()
    kv = tmp_path / "src/dynamo_ftctl/kv"
    kv.mkdir(parents=True)
    for name in ("native.py", "_rowcopy.c"):
        shutil.copy(REPO / "src/dynamo_ftctl/kv" / name, kv / name)
    before = _tree(tmp_path)
    monkeypatch.setenv("CC", compiler)
    instance = hook.CustomBuildHook(str(tmp_path), {}, None, None, str(tmp_path), "wheel")
    build_data: dict[str, Any] = {"artifacts": [], "force_include": {}}
    instance.initialize("standard", build_data)
    if compiler == "cc":
        ((built, inside),) = build_data["force_include"].items()
        assert inside == "dynamo_ftctl/kv/_rowcopy.so"
        assert not Path(built).is_relative_to(tmp_path)
        assert build_data["pure_python"] is False
        tag = build_data["tag"]
        assert tag.startswith("py3-none-")
        assert tag != "py3-none-any"
        assert native.load(Path(built), openmp=False) is not None
        instance.finalize("standard", build_data, str(tmp_path / "x.whl"))
        assert not Path(built).parent.exists()
    else:
        assert build_data == {"artifacts": [], "force_include": {}}
        assert "KV row-copy kernel not built" in capsys.readouterr().err
    assert _tree(tmp_path) == before  # nothing written into the source tree (pycache aside)


def test_install_hook_builds_nothing_for_an_editable_install(tmp_path: Path) -> None:
    """An editable install ships no kernel (it would be a file in src/): the package
    compiles one on first use into the user's cache instead."""
    hook = hook_module()
    instance = hook.CustomBuildHook(str(REPO), {}, None, None, str(tmp_path), "wheel")
    build_data: dict[str, Any] = {"artifacts": [], "force_include": {}}
    instance.initialize("editable", build_data)
    assert build_data == {"artifacts": [], "force_include": {}}


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty $XDG_CACHE_HOME of this test's own, with the cache on."""
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv("FTCTL_NO_CACHE", raising=False)
    return home


def test_a_checkout_compiles_the_kernel_once_into_the_cache(cache_home: Path) -> None:
    """Without a library beside native.py, the kernel is compiled on first use into
    $XDG_CACHE_HOME/ftctl/kernels (this user's, mode 0700) and reused after; it is never
    written into src/."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    first = native.cached_library()
    assert first is not None
    assert first.parent == cache_home / "ftctl" / "kernels"
    assert first.parent.stat().st_mode & 0o777 == 0o700
    built_at = first.stat().st_mtime_ns
    assert native.cached_library() == first
    assert first.stat().st_mtime_ns == built_at  # reused, not rebuilt
    assert native.load(first, openmp=False) is not None
    assert not native.LIBRARY.exists()


def test_an_edited_source_gets_its_own_cached_kernel(cache_home: Path, tmp_path: Path) -> None:
    """The cache names a kernel by its source: an edited source is compiled anew."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    edited = tmp_path / "edited.c"
    edited.write_text(native.SOURCE.read_text() + "\n/* edited */\n")
    assert native.cached_library() != native.cached_library(edited)


def test_the_kernel_cache_is_skipped_when_off_or_not_ours(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any,
) -> None:
    """FTCTL_NO_CACHE, a kernels directory others may write, and no compiler at all each
    give None: torch's kernels copy (a missing compiler says nothing)."""
    monkeypatch.setenv("FTCTL_NO_CACHE", "1")
    assert native.cached_library() is None
    monkeypatch.delenv("FTCTL_NO_CACHE")
    kernels = cache_home / "ftctl" / "kernels"
    kernels.mkdir(parents=True)
    kernels.chmod(0o777)
    assert native.cached_library() is None
    assert list(kernels.iterdir()) == []
    kernels.chmod(0o700)
    monkeypatch.setenv("CC", str(cache_home / "no-such-cc"))
    assert native.cached_library() is None
    assert capsys.readouterr().err == ""


def test_a_failed_first_use_build_warns_once_and_falls_back(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any,
) -> None:
    """A compiler that fails gives None and one warning line naming the cache directory."""
    monkeypatch.setenv("CC", "false")
    assert native.cached_library() is None
    err = capsys.readouterr().err
    assert "KV row-copy kernel not built in" in err
    assert len(err.strip().splitlines()) == 1


def test_kernel_prefers_the_wheels_library_then_the_cache(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, row_kernel: native.RowKernel,
) -> None:
    """`kernel()` loads LIBRARY when a wheel shipped it, else the cached build."""
    native.kernel.cache_clear()
    try:
        monkeypatch.setattr(native, "LIBRARY", row_kernel.path)
        loaded = native.kernel()
        assert loaded is not None
        assert loaded.path == row_kernel.path
        native.kernel.cache_clear()
        monkeypatch.setattr(native, "LIBRARY", cache_home / "absent.so")
        loaded = native.kernel()
        assert loaded is not None
        assert loaded.path.parent == cache_home / "ftctl" / "kernels"
    finally:
        native.kernel.cache_clear()


def test_native_builds_where_the_package_is_not_installed(tmp_path: Path) -> None:
    """hatch_build.py loads kv/native.py by path while pip installs the package: with no
    dynamo_ftctl importable (`python -S -I`: no site-packages, no PYTHONPATH), it still
    builds the kernel (CI's fresh clone failed once: native.py imported the package)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    out = tmp_path / "k.so"
    NATIVE_PY = REPO / "src/dynamo_ftctl/kv/native.py"  # noqa: N806
    script = (
        "import importlib.util, sys\n"
        "from pathlib import Path\n"
        f"spec = importlib.util.spec_from_file_location('n', {str(NATIVE_PY)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'dynamo_ftctl' not in sys.modules\n"
        f"m.build(Path({str(out)!r}), source=m.SOURCE)\n"
    )
    done = subprocess.run([sys.executable, "-S", "-I", "-c", script], capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0
