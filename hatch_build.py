"""Build hook: compile the KV row-copy kernel (src/dynamo_ftctl/kv/_rowcopy.c) for wheels and
editable installs, with the platform's C compiler (no Python headers needed).

A missing compiler or a failed build never fails the install: the hook warns and the block
copier uses torch's kernels instead (dynamo_ftctl/kv/native.py says how it is loaded).
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NATIVE = Path("src/dynamo_ftctl/kv/native.py")
LIBRARY = "src/dynamo_ftctl/kv/_rowcopy.so"


def _native(root: Path) -> ModuleType:
    """kv/native.py, loaded by path: the package is not installed yet."""
    spec = importlib.util.spec_from_file_location("_ftctl_kv_native", root / NATIVE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_kernel(root: Path) -> str | None:
    """Build the kernel in place; None when it was built, else why not (one line)."""
    native = _native(root)
    try:
        native.build(root / LIBRARY, source=native.SOURCE)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()
        return f"{exc.cmd[0]} failed: {detail[0] if detail else f'exit {exc.returncode}'}"
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compile `_rowcopy.so` and ship it in the wheel, or warn and ship none."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        del version
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        problem = compile_kernel(root)
        if problem is not None:
            self.app.display_warning(
                f"dynamo-ftctl: KV row-copy kernel not built ({problem}); "
                "the block copier will use torch's kernels")
            (root / LIBRARY).unlink(missing_ok=True)  # never ship a stale one
            return
        # The library is git-ignored (src/dynamo_ftctl/kv/.gitignore): include it anyway.
        build_data["artifacts"].append(LIBRARY)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
