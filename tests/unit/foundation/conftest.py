"""Fixtures of the foundation tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The parsed-YAML cache, on and empty, in this test's temp dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("FTCTL_NO_CACHE", raising=False)
    return tmp_path / "cache" / "ftctl" / "yaml"
