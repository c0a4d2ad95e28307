"""Build hook: compile the KV row-copy kernel (src/dynamo_ftctl/kv/_rowcopy.c) for wheels,
with the platform's C compiler (no Python headers needed).

The kernel is a plain shared library loaded with ctypes, with no Python ABI, so the wheel
is tagged `py3-none-<platform>`: one wheel for every CPython >= 3.11 on that platform. It
is compiled into a temporary directory of the hook's own and shipped through
`force_include`; the source tree is never written. An editable install builds nothing
here: the package compiles the kernel on first use into the user's cache
(dynamo_ftctl/kv/native.py, `cached_library`).

A missing compiler or a failed build never fails the install: the hook warns, the wheel is
pure (`py3-none-any`) and the block copier uses torch's kernels (or compiles on first use
where a compiler appears later).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NATIVE = Path("src/dynamo_ftctl/kv/native.py")
SOURCE = Path("src/dynamo_ftctl/kv/_rowcopy.c")
LIBRARY = "dynamo_ftctl/kv/_rowcopy.so"  # its path inside the wheel


def _native(root: Path) -> ModuleType:
    """kv/native.py, loaded by path: the package is not installed yet."""
    spec = importlib.util.spec_from_file_location("_ftctl_kv_native", root / NATIVE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_kernel(root: Path, out: Path) -> str | None:
    """Build the kernel from `root`'s source into `out`; None when it was built, else why
    not (one line)."""
    native = _native(root)
    try:
        native.build(out, source=root / SOURCE)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()
        return f"{exc.cmd[0]} failed: {detail[0] if detail else f'exit {exc.returncode}'}"
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None


def platform_tag() -> str:
    """The wheel tag of a library that needs no Python ABI: `py3-none-<this platform>`,
    the platform as hatchling's own `infer_tag` names it (manylinux/musllinux skipped:
    the compiler's libc is not audited)."""
    from packaging.tags import sys_tags

    platform = next(t.platform for t in sys_tags()
                    if "manylinux" not in t.platform and "musllinux" not in t.platform)
    if sys.platform == "darwin":
        from hatchling.builders.macos import process_macos_plat_tag

        platform = process_macos_plat_tag(platform, compat=False)
    return f"py3-none-{platform}"


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compile `_rowcopy.so` into a temporary directory and ship it in the wheel as a
    `py3-none-<platform>` wheel, or warn and ship a pure one."""

    _scratch: Path | None = None

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        self._scratch = Path(tempfile.mkdtemp(prefix="ftctl-rowcopy-"))
        out = self._scratch / "_rowcopy.so"
        problem = compile_kernel(Path(self.root), out)
        if problem is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
            self.app.display_warning(
                f"dynamo-ftctl: KV row-copy kernel not built ({problem}); "
                "the block copier will use torch's kernels")
            return
        build_data.setdefault("force_include", {})[str(out)] = LIBRARY
        build_data["pure_python"] = False
        build_data["tag"] = platform_tag()

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        del version, build_data, artifact_path
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
