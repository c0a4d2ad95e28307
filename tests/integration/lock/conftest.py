"""Lock tests run with a short stop bound: every new lock file is held for the bound
(watch interval + TERM grace + 0.5 s) before its token is issued, 6 s with the defaults.

The pod-wide variables set it, for in-process locks and the `ftctl` processes the tests
start alike (0.1 + 0.2 + 0.5 = 0.8 s); a test about the bound sets its own.
"""

from __future__ import annotations

import pytest

from tests.integration.lock.hostile_files import short_stop_bound


@pytest.fixture(autouse=True)
def _short_stop_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    short_stop_bound(monkeypatch)
