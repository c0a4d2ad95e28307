"""Build hook: compile the KV row-copy kernel (src/dynamo_ftctl/kv/_rowcopy.c) for wheels,
with the platform's C compiler (no Python headers needed); and, only when asked
(`FTCTL_MYPYC=1`, `make compiled`), the proxy's hot modules with mypyc.

The kernel is a plain shared library loaded with ctypes, with no Python ABI, so the wheel
is tagged `py3-none-<platform>`: one wheel for every CPython >= 3.11 on that platform. It
is compiled into a temporary directory of the hook's own and shipped through
`force_include`; the source tree is never written. An editable install builds nothing
here: the package compiles the kernel on first use into the user's cache
(dynamo_ftctl/kv/native.py, `cached_library`).

A missing compiler or a failed build never fails the install: the hook warns, the wheel is
pure (`py3-none-any`) and the block copier uses torch's kernels (or compiles on first use
where a compiler appears later).

The compiled build (`MYPYC_MODULES`: the proxy's per-request and per-token path; its
async generators, which mypyc cannot compile, are in proxy/streams.py) ships each
module's extension beside its `.py`; Python imports the extension first, the `.py` is
the fallback where it is absent.
The wheel is then tagged for this CPython and platform (`cp311-cp311-linux_x86_64`). A
failed mypyc build warns and ships the pure modules, as the kernel does.
"""

from __future__ import annotations

import importlib.util
import os
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
# The modules `FTCTL_MYPYC=1` compiles, under src/: what a proxied request runs per token
# and per request outside the event loop's C (docs/benchmarks.md, proxy_peers.py). The
# streamed path's async generators, which mypyc cannot compile, live in proxy/streams.py.
MYPYC_MODULES = (
    "dynamo_ftctl/sse.py",
    "dynamo_ftctl/jsoncodec.py",
    "dynamo_ftctl/httpserver/_connection.py",
    "dynamo_ftctl/httpserver/_messages.py",
    "dynamo_ftctl/http1/connection.py",
    "dynamo_ftctl/http1/response.py",
    "dynamo_ftctl/http1/pool.py",
    "dynamo_ftctl/proxy/admission.py",
    "dynamo_ftctl/proxy/attempt.py",
    "dynamo_ftctl/proxy/balancer.py",
    "dynamo_ftctl/proxy/board.py",
    "dynamo_ftctl/proxy/chunk.py",
    "dynamo_ftctl/proxy/codec.py",
    "dynamo_ftctl/proxy/continuation.py",
    "dynamo_ftctl/proxy/fleet.py",
    "dynamo_ftctl/proxy/frontdoor.py",
    "dynamo_ftctl/proxy/judgment.py",
    "dynamo_ftctl/proxy/ledger.py",
    "dynamo_ftctl/proxy/policy.py",
    "dynamo_ftctl/proxy/prefix.py",
    "dynamo_ftctl/proxy/reader.py",
    "dynamo_ftctl/proxy/tally.py",
)
MYPYC_TIMEOUT_S = 900


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


def compile_modules(root: Path, out: Path,
                    modules: tuple[str, ...] = MYPYC_MODULES) -> list[str] | str:
    """mypyc-compile `modules` of `root`'s src/ into `out` (a copy of src/ is built, `root`
    is never written); the extensions' paths under `out`, relative (the modules' and
    mypyc's shared runtime library), or why not (one line)."""
    scratch = Path(tempfile.mkdtemp(prefix="ftctl-mypyc-"))
    try:
        shutil.copytree(root / "src", scratch / "src",
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        shutil.copy2(root / "pyproject.toml", scratch / "pyproject.toml")  # mypy's settings
        try:
            subprocess.run([sys.executable, "-m", "mypyc",
                            *(f"src/{module}" for module in modules)],
                           cwd=scratch, check=True, capture_output=True, text=True,
                           timeout=MYPYC_TIMEOUT_S,
                           env={**os.environ, "MYPYC_OPT_LEVEL": "3"})
        except subprocess.CalledProcessError as exc:
            lines = (exc.stdout + exc.stderr).strip().splitlines()
            errors = [line for line in lines if "error" in line] or lines[-1:]
            return f"mypyc failed: {errors[0] if errors else f'exit {exc.returncode}'}"
        except (OSError, subprocess.SubprocessError) as exc:
            return f"mypyc failed: {exc}"
        built = sorted(path.relative_to(scratch / "src")
                       for path in (scratch / "src").rglob("*.so"))
        if not built:
            return "mypyc built no extension"
        for path in built:
            (out / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(scratch / "src" / path, out / path)
        return [str(path) for path in built]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
        self._scratch = Path(tempfile.mkdtemp(prefix="ftctl-build-"))
        out = self._scratch / "_rowcopy.so"
        problem = compile_kernel(Path(self.root), out)
        if problem is not None:
            self.app.display_warning(
                f"dynamo-ftctl: KV row-copy kernel not built ({problem}); "
                "the block copier will use torch's kernels")
        else:
            build_data.setdefault("force_include", {})[str(out)] = LIBRARY
            build_data["pure_python"] = False
            build_data["tag"] = platform_tag()
        if os.environ.get("FTCTL_MYPYC") == "1":
            self._compile(build_data)

    def _compile(self, build_data: dict[str, Any]) -> None:
        assert self._scratch is not None
        out = self._scratch / "mypyc"
        built = compile_modules(Path(self.root), out)
        if isinstance(built, str):
            self.app.display_warning(
                f"dynamo-ftctl: proxy modules not compiled ({built}); the wheel ships "
                "them as Python")
            return
        include = build_data.setdefault("force_include", {})
        for path in built:
            include[str(out / path)] = path
        build_data["pure_python"] = False
        build_data.pop("tag", None)
        build_data["infer_tag"] = True  # the extensions' CPython ABI and platform

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        del version, build_data, artifact_path
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
