"""A missing optional extra: one line naming the extra to install, exit 2, no traceback."""

from __future__ import annotations

import importlib.util

import pytest

from dynamo_ftctl.cli._light import guarded
from dynamo_ftctl.errors import EXTRA_OF_MODULE, ExitCode, MissingExtra, require_extra


@pytest.mark.parametrize(("module", "extra"), sorted(EXTRA_OF_MODULE.items()))
def test_guarded_names_the_extra_of_a_missing_module(
    module: str, extra: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """An extra's module missing at run time becomes the install hint and exit 2."""

    def needs_it() -> int:
        raise ModuleNotFoundError(f"No module named '{module}.sub'", name=f"{module}.sub")

    assert guarded(needs_it, debug=False) == ExitCode.USAGE
    assert capsys.readouterr().err == (
        f"error: this command needs {module}, from the {extra} extra: "
        f"pip install 'dynamo-ftctl[{extra}]'\n")


def test_guarded_keeps_the_traceback_of_a_missing_base_module() -> None:
    """A base dependency missing is a broken install, not a hint: the error propagates."""

    def broken() -> int:
        raise ModuleNotFoundError("No module named 'httptools'", name="httptools")

    with pytest.raises(ModuleNotFoundError, match="httptools"):
        guarded(broken, debug=False)


def test_require_extra_raises_for_an_absent_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """require_extra looks the module up (no import) and names its extra when it is absent."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(MissingExtra, match=r"pip install 'dynamo-ftctl\[gpu\]'") as info:
        require_extra("pynvml")
    assert info.value.exit_code == ExitCode.USAGE


def test_require_extra_passes_for_an_installed_module() -> None:
    """An importable module raises nothing (numpy is in the dev environment)."""
    require_extra("numpy")
