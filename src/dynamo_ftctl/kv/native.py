"""The native row-copy kernel (`_rowcopy.c`), a plain shared library loaded with ctypes.

torch's CPU `index_select`/`index_copy_` dispatch a small copy per row (or per
element) and have no op for random rows to random rows, which then takes two
passes through a staging buffer. `_rowcopy.c` copies any of the three patterns
in one pass of `memcpy`-sized rows, streaming large copies past the cache,
on torch's own intra-op threads (its OpenMP team,
`RowKernel.team`) or, where torch has none, a pool of the kernel's own.

The library has no Python ABI (no Python headers, no module init; ctypes calls
C functions), so one build serves every CPython on its platform: the wheel is
tagged `py3-none-<platform>`. `kernel()` finds it in one of two places:

- `LIBRARY`, beside this file: a wheel's build (`hatch_build.py` calls `build()`
  into its temporary directory and ships the result here);
- else, for a source checkout, an editable install or a wheel built without a
  compiler, `cached_library()`: compiled on first use into
  `$XDG_CACHE_HOME/ftctl/kernels/` (default `~/.cache/ftctl/kernels/`), named by
  a hash of the source, the ABI and the machine, so an edited source gets a new
  name. Only a directory and a file that are this user's own and writable by no
  one else are loaded from; `FTCTL_NO_CACHE=1` skips the cache.

Nothing is ever written beside this file. Without a compiler (or with a failed
build) the copier falls back to torch's kernels (`kernel()` is None);
`FTCTL_KV_NATIVE=0` disables the kernel at run time.
Stdlib only at import: the build hook loads this file before the package exists.
"""

from __future__ import annotations

import ctypes
import os
import stat
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = [
    "ABI", "BAD_IDS", "LIBRARY", "NO_MEMORY", "RUN_NONE", "SOURCE", "STREAM_MIN_BYTES",
    "RowKernel", "build", "cache_dir", "cached_library", "kernel", "last_level_cache_bytes",
    "load",
]

SOURCE = Path(__file__).with_name("_rowcopy.c")
LIBRARY = Path(__file__).with_name("_rowcopy.so")  # where a wheel ships it; never built here
ABI = 6  # must equal ftctl_rowcopy_abi() in _rowcopy.c


def last_level_cache_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of the largest cache `cpu` (Linux sysfs) lists, or None where it lists none."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for entry in cpu.glob("index*/size"):
        text = entry.read_text().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=None)


# Copies of at least this many bytes stream their stores past the cache. Measured with
# `kv bench --cache cold` (both copies start from DRAM): 1k 4 KiB blocks (4 MiB) take
# 670-830 us on one thread and 560-600 us on two streamed, 910-1070 and 640-860 us with
# cached stores, the same-run contiguous copy_ 360-620 us either way. (Warm, back to back,
# the copier's time is the same either way; what changes is the baseline's next run:
# streamed stores leave the destination lines it rewrites out of the cache.) A smaller
# copy's rows stay cached for whoever reads them next.
STREAM_MIN_BYTES = 1 << 20
# What `RowKernel.check_ids` answers besides a run's first block (and `copy_blocks` fails with).
RUN_NONE, BAD_IDS, NO_MEMORY = -1, -2, -3


def build(out: Path = LIBRARY, *, source: Path = SOURCE, timeout_s: float = 120.0) -> Path:
    """Compile `source` into the shared library `out`; raises OSError,
    subprocess.CalledProcessError (with the compiler's output) or
    subprocess.TimeoutExpired when it cannot."""
    import shlex
    import shutil
    import subprocess
    import sysconfig

    cc = shlex.split(os.environ.get("CC") or "")
    if not cc:  # the compiler Python was built with, when this machine has it; else cc
        cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
        if shutil.which(cc[0]) is None:
            cc = ["cc"]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        # subprocess, not the package's process seam: hatch_build.py loads this module by
        # path while the package is being installed, so it may import the stdlib only.
        subprocess.run(
            [*cc, "-O2", "-shared", "-fPIC", "-std=c11", "-pthread", "-o", str(partial),
             str(source)], check=True, capture_output=True, text=True, timeout=timeout_s)
        partial.chmod(0o755)  # whatever the umask: a group-writable library is not loaded
        partial.replace(out)  # atomic: a concurrent loader never sees half a library
    finally:
        partial.unlink(missing_ok=True)
    return out


class RowKernel:
    """`_rowcopy.c` loaded from `path`: `copy_blocks` between host layers of byte rows.

    A copy larger than one piece (256 KiB) is shared among torch's intra-op threads:
    `team` says on which. "openmp": torch's own OpenMP team (GOMP_parallel, what its
    `at::parallel_for` runs on), when torch's parallel backend is OpenMP and `openmp`
    is true; "pool": the kernel's own threads, started once and kept (also what a child
    of fork() uses, where OpenMP cannot run)."""

    def __init__(self, path: Path, *, openmp: bool = True) -> None:
        lib = ctypes.CDLL(str(path))
        abi = lib.ftctl_rowcopy_abi
        abi.restype = ctypes.c_int
        if abi() != ABI:
            msg = f"{path}: kernel ABI {abi()}, this package needs {ABI} (reinstall to rebuild)"
            raise OSError(msg)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        check = lib.ftctl_check_ids
        check.argtypes = [ptr, i64, i64]
        check.restype = i64
        whole = lib.ftctl_copy_blocks
        whole.argtypes = [i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
        whole.restype = i64
        self._check, self._whole = check, whole
        self.path = path
        parallel = _openmp_parallel() if openmp else None
        use = lib.ftctl_use_openmp
        use.argtypes = [ptr]
        use.restype = None
        use(parallel)
        self.team = "pool" if parallel is None else "openmp"

    def check_ids(self, ids: torch.Tensor, num_blocks: int) -> int:
        """For 1 or more contiguous int64 host `ids` of a cache of `num_blocks`: the first
        id (>= 0) when they are one ascending run, RUN_NONE when they are distinct,
        BAD_IDS when one is out of range or repeats (the caller names it)."""
        status = int(self._check(ids.data_ptr(), ids.shape[0], num_blocks))
        if status >= 0:
            return status
        return BAD_IDS if status in (-1, -2) else RUN_NONE

    def copy_blocks(
        self, at: Sequence[int], dst_ids: torch.Tensor, src_ids: torch.Tensor, *,
        dst_blocks: int, src_blocks: int, row_bytes: int, threads: int,
    ) -> int:
        """One whole copy in one call: check both id lists, order the rows, copy every
        layer. `at` is the destination layers' addresses, the source layers', then their
        row strides in bytes (destination, source): 4 values a layer. Ids are 1-D
        contiguous int64 host tensors of equal length (rows `dst_blocks` and `src_blocks`
        long), which the kernel checks (range, repeats) before it copies anything.
        Returns 0, BAD_IDS (an id out of range or repeated: the caller names it) or
        NO_MEMORY; nothing was copied unless 0."""
        layers = len(at) // 4
        status = int(self._whole(layers, (ctypes.c_int64 * len(at))(*at), dst_ids.data_ptr(),
                                 dst_blocks, src_ids.data_ptr(), src_blocks,
                                 src_ids.shape[0], row_bytes, STREAM_MIN_BYTES, threads))
        return {0: 0, -1: BAD_IDS}.get(status, NO_MEMORY)


def _openmp_parallel() -> int | None:
    """The address of GOMP_parallel in this process when torch runs its intra-op work on
    OpenMP (GNU's runtime, or LLVM's or Intel's, which export the same entry), else None."""
    try:
        import torch
    except ImportError:  # pragma: no cover (the copier needs torch; the kernel alone not)
        return None
    if not torch._C.has_openmp:  # what torch.backends.openmp.is_available() reads
        return None
    try:
        entry = ctypes.CDLL(None).GOMP_parallel  # torch loads its OpenMP runtime globally
    except AttributeError:
        return None
    address = ctypes.cast(entry, ctypes.c_void_p).value
    return int(address) if address else None


def load(path: Path = LIBRARY, *, openmp: bool = True) -> RowKernel | None:
    """The kernel at `path` (`openmp`: see RowKernel), or None when it is missing or cannot
    be loaded."""
    if not path.is_file():
        return None
    try:
        return RowKernel(path, openmp=openmp)
    except (OSError, AttributeError) as exc:  # wrong architecture, stale ABI, not ours
        from dynamo_ftctl.output import warn

        warn(f"KV row-copy kernel not used, torch's kernels copy instead: {exc}")
        return None


def cache_dir() -> Path | None:
    """Where `cached_library` compiles the kernel, or None when the cache is off."""
    from dynamo_ftctl.safefiles import user_cache_dir

    return user_cache_dir("kernels")


def _ours(path: Path) -> bool:
    """Owned by this user and writable by no one else (a library others could replace
    would run their code in this process)."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def cached_library(source: Path = SOURCE) -> Path | None:
    """The kernel compiled from `source` in `cache_dir()`, built on first use; None when
    there is no cache, no compiler, the build failed (one warning) or the directory or
    file is not this user's own."""
    import platform
    import subprocess

    directory = cache_dir()
    if directory is None or not source.is_file():
        return None
    try:
        text = source.read_bytes()
    except OSError:
        return None
    try:  # what hashlib.blake2b is, without hashlib's import of OpenSSL
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - CPython always builds _blake2
        from hashlib import blake2b
    digest = blake2b(f"rowcopy/{ABI} {platform.system()} {platform.machine()}\n".encode()
                     + text, digest_size=12).hexdigest()
    path = directory / f"rowcopy-{digest}.so"
    if not path.is_file():
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None
        if not _ours(directory):
            return None
        try:
            build(path, source=source)
        except FileNotFoundError:  # no C compiler: torch's kernels copy, quietly
            return None
        except (OSError, subprocess.SubprocessError) as exc:
            from dynamo_ftctl.output import warn

            detail = getattr(exc, "stderr", None) or str(exc)
            first = detail.strip().splitlines()[0] if detail.strip() else type(exc).__name__
            warn(f"KV row-copy kernel not built in {directory}, torch's kernels copy "
                 f"instead: {first}")
            return None
    return path if _ours(directory) and _ours(path) else None


@lru_cache(maxsize=1)
def kernel() -> RowKernel | None:
    """The kernel, once per process: the wheel's (`LIBRARY`), else `cached_library()`;
    None when neither loads or FTCTL_KV_NATIVE=0."""
    if os.environ.get("FTCTL_KV_NATIVE", "1") == "0":
        return None
    if LIBRARY.is_file():
        return load(LIBRARY)
    cached = cached_library()
    return None if cached is None else load(cached)
