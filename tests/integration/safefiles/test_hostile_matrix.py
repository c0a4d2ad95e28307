"""The hostile-file matrix (tests/hostilefiles.py): every option that writes a file or a log
refuses links, FIFOs, devices, sockets and hard links, and data-built names stay inside."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hostilefiles import KINDS, OPTIONS, Option, run_matrix, traversal_row


@pytest.mark.parametrize("option", OPTIONS, ids=[o.name for o in OPTIONS])
def test_each_hostile_kind_is_refused(option: Option) -> None:
    """Exit 2 with one line naming the path (a hard link: cut by the rename), the victim
    unchanged, nothing half-written, no hang; for each planted kind."""
    rows = run_matrix((option,), KINDS, traversal=False)
    assert [r for r in rows if not r.ok] == []


def test_a_model_id_cannot_lead_the_default_path_out(tmp_path: Path) -> None:
    """`canary record --model ../../../victimdir/x` writes inside canaries/ (issue 30)."""
    row = traversal_row(tmp_path)
    assert row.ok, row.observed
