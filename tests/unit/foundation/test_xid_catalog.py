"""The Xid catalog: coverage of the issue's codes, lookups and per-event actions."""

from __future__ import annotations

import dataclasses

import pytest

from dynamo_ftctl.errors import ExitCode, InvalidInput
from dynamo_ftctl.xid import (
    XID_CATALOG,
    XidAction,
    XidInfo,
    action_for_message,
    lookup_xid,
)

REQUIRED = [13, 31, 32, 38, 43, 45, 48, 56, 57, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95,
            109, 119, 120, 121, 140, 143, *range(144, 151), 154]


@pytest.mark.parametrize("code", REQUIRED)
def test_every_required_code_is_cataloged(code: int) -> None:
    """Each Xid the issue names has a complete entry keyed by its own code."""
    info = XID_CATALOG[code]
    assert info.code == code
    assert info.name
    assert info.meaning
    assert info.cause
    assert info.source
    assert isinstance(info.action, XidAction)
    assert info.effect in ("crash", "request", "hang", "log")


def test_key_actions_follow_nvidia() -> None:
    """The well-known codes carry NVIDIA's immediate actions."""
    assert lookup_xid(48).action is XidAction.RESET_GPU
    assert lookup_xid(79).action is XidAction.RESTART_BM
    assert lookup_xid(95).action is XidAction.RESET_GPU
    assert lookup_xid(94).action is XidAction.RESTART_APP
    assert lookup_xid(13).action is XidAction.RESTART_APP
    assert lookup_xid(45).action is XidAction.IGNORE
    assert lookup_xid(92).action is XidAction.IGNORE


@pytest.mark.parametrize(("code", "name", "action"), [
    (31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", XidAction.RESTART_APP),
    (32, "ROBUST_CHANNEL_PBDMA_ERROR", XidAction.RESTART_APP),
    (38, "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", XidAction.IGNORE),
    (43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", XidAction.IGNORE),
    (48, "ROBUST_CHANNEL_GPU_ECC_DBE", XidAction.RESET_GPU),
    (61, "PMU_BREAKPOINT", XidAction.CONTACT_SUPPORT),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", XidAction.RESET_GPU),
    (109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", XidAction.RESET_GPU),
    (121, "C2C_ERROR", XidAction.IGNORE),
    (140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", XidAction.RESET_GPU),
    (143, "GPU_INIT_ERROR", XidAction.RESET_GPU),
])
def test_rows_match_nvidias_catalog(code: int, name: str, action: XidAction) -> None:
    """Mnemonic and immediate action are those of NVIDIA's Xid catalog for Ampere and newer."""
    info = lookup_xid(code)
    assert (info.name, info.action) == (name, action)


def test_injection_effects() -> None:
    """Effects used by fault injection: crash, contained request failure, hang, log-only."""
    assert lookup_xid(48).effect == "crash"
    assert lookup_xid(79).effect == "crash"
    assert lookup_xid(95).effect == "crash"
    assert lookup_xid(94).effect == "request"
    assert lookup_xid(43).effect == "hang"
    assert lookup_xid(63).effect == "log"
    assert lookup_xid(92).effect == "log"
    assert lookup_xid(48).fatal
    assert not lookup_xid(63).fatal


def test_entries_are_frozen_and_catalog_read_only() -> None:
    """Nobody can change Xid facts at run time."""
    info = lookup_xid(48)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.action = XidAction.IGNORE  # type: ignore[misc]
    with pytest.raises(TypeError):
        XID_CATALOG[1] = info  # type: ignore[index]
    assert isinstance(info, XidInfo)


def test_unknown_code_is_invalid_input_with_known_list() -> None:
    """An unknown code raises InvalidInput (exit 2) naming the cataloged codes."""
    with pytest.raises(InvalidInput) as caught:
        lookup_xid(9999)
    assert caught.value.exit_code == ExitCode.USAGE
    assert "9999" in str(caught.value)
    assert "48" in str(caught.value)


def test_action_enum_is_ordered_by_severity() -> None:
    """Severity ranks let a watcher pick the worst of several actions."""
    ranked = sorted(XidAction, key=lambda a: a.severity)
    assert ranked[0] is XidAction.IGNORE
    assert ranked[-1] is XidAction.CONTACT_SUPPORT
    assert all(a.summary for a in XidAction)
    assert XidAction("RESET_GPU") is XidAction.RESET_GPU


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
         XidAction.RESET_GPU),
        ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
         XidAction.RESTART_BM),
        ("GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)",
         XidAction.IGNORE),
        ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", XidAction.RESTART_APP),
        ("something new", XidAction.RESET_GPU),
    ],
)
def test_xid_154_action_comes_from_the_message(message: str, expected: XidAction) -> None:
    """Xid 154 names the recovery the driver wants; the new state wins."""
    assert action_for_message(154, message) is expected


def test_action_for_other_codes_is_the_catalog_action() -> None:
    """Other codes keep their catalog action; unknown codes go to a human."""
    assert action_for_message(48, "anything") is XidAction.RESET_GPU
    assert action_for_message(7, "x") is XidAction.CONTACT_SUPPORT
