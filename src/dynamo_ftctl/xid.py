"""The Xid catalog: what each actionable NVIDIA Xid means and what to do about it.

This module is the one place that fault injection (`faults/`), the GPU watchers
(`gpu/`) and the canary daemon take Xid facts from. It holds data only: no I/O,
no NVML, no parsing of kernel-log lines (that is `gpu/kmsg.py`).

Sources. `action` is the "Resolution Bucket (Immediate Action)" of NVIDIA's Xid
catalog for Ampere and newer GPUs
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, "NV
catalog" below); causes follow NVIDIA's Xid documentation ("Xid errors"
whitepaper, https://docs.nvidia.com/deploy/xid-errors/) and the GPU memory error
management guide for A100/H100 (row remapping, containment,
https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/). Where the catalog's
action depends on details of the event (Xid 74 and 144-150 carry severity bits,
Xid 154 names its own recovery action) the entry holds the conservative action
and `action_for_message` refines it from the log text. Likewise for the
catalog's WORKFLOW_* buckets (45, 48, 74): the entry holds the action the
workflow ends in. `name` is the catalog's mnemonic (the driver's `nverror.h`).

`effect` is how the fault shows to a serving engine, for injection:
"crash" (the engine process ends with the Xid logged), "request" (only the
request that touched the fault fails), "hang" (the engine stops making progress)
or "log" (logged only; serving continues).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Literal

from dynamo_ftctl.errors import InvalidInput

__all__ = [
    "XID_CATALOG",
    "XidAction",
    "XidEffect",
    "XidInfo",
    "action_for_message",
    "lookup_xid",
]

XidEffect = Literal["crash", "request", "hang", "log"]

_NV_CATALOG = "NVIDIA Xid catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html)"
_NV_MEMORY = (
    "NVIDIA GPU memory error management (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/)"
)


class XidAction(StrEnum):
    """NVIDIA's resolution buckets, mildest first."""

    IGNORE = "IGNORE"
    RESTART_APP = "RESTART_APP"
    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"

    @property
    def severity(self) -> int:
        """Rank for "the worst of several actions" (0 = IGNORE)."""
        return _SEVERITY[self]

    @property
    def summary(self) -> str:
        """What an operator does, in a few words."""
        return _SUMMARY[self]


_SEVERITY = {
    XidAction.IGNORE: 0,
    XidAction.RESTART_APP: 1,
    XidAction.RESET_GPU: 2,
    XidAction.RESTART_BM: 3,
    XidAction.CONTACT_SUPPORT: 4,
}

_SUMMARY = {
    XidAction.IGNORE: "no action; keep serving (trend it)",
    XidAction.RESTART_APP: "restart the engine on this GPU",
    XidAction.RESET_GPU: "drain the worker, reset the GPU (nvidia-smi -r), then restart",
    XidAction.RESTART_BM: "drain the node and reboot it (bare-metal restart)",
    XidAction.CONTACT_SUPPORT: "drain, collect nvidia-bug-report, contact support / RMA",
}


@dataclass(frozen=True)
class XidInfo:
    """One Xid: its catalog facts plus the effect fault injection simulates."""

    code: int
    name: str
    meaning: str
    cause: str
    action: XidAction
    source: str
    effect: XidEffect

    @property
    def fatal(self) -> bool:
        """True when the engine on this GPU cannot keep serving as is."""
        return self.effect in ("crash", "hang")


def _xid(  # noqa: PLR0917 - one table row per call reads best positionally
    code: int, name: str, meaning: str, cause: str, action: XidAction, effect: XidEffect,
    source: str = _NV_CATALOG,
) -> XidInfo:
    return XidInfo(code, name, meaning, cause, action, source, effect)


_A = XidAction

_ROWS: tuple[XidInfo, ...] = (
    _xid(13, "ROBUST_CHANNEL_GR_EXCEPTION", "Graphics Engine Exception",
         "an application fault (out-of-range access, illegal instruction); rarely hardware",
         _A.RESTART_APP, "crash"),
    _xid(31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault",
         "an illegal memory access by the application (MMU fault); rarely driver or hardware",
         _A.RESTART_APP, "crash"),
    _xid(32, "ROBUST_CHANNEL_PBDMA_ERROR", "Invalid or corrupted push buffer stream",
         "the DMA controller between driver and GPU reported a fault: mostly PCIe link "
         "quality, rarely the application", _A.RESTART_APP, "crash"),
    _xid(38, "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "Driver firmware error",
         "the GPU's context-switch firmware (FECS) watchdog timed out; driver or firmware",
         _A.IGNORE, "log"),
    _xid(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing",
         "the application hit a software-induced fault and its channel was stopped; "
         "the GPU itself stays healthy", _A.IGNORE, "hang"),
    _xid(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "Preemptive cleanup, due to previous errors",
         "channels torn down after a process exit, kill or an earlier Xid (look at the "
         "Xid before it)", _A.IGNORE, "log"),
    _xid(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "Double Bit ECC Error (uncorrectable memory error)",
         "an uncorrectable error in GPU memory; hardware. The row is remapped on the next "
         "GPU reset", _A.RESET_GPU, "crash", _NV_CATALOG + "; " + _NV_MEMORY),
    # 56, 57 and 61 are "Unused" on A100/H100/B100/GB200 in NVIDIA's catalog (its
    # bucket for those is CONTACT_SUPPORT); kept for older GPUs, meanings from the
    # Xid whitepaper.
    _xid(56, "DISPLAY_CHANNEL_EXCEPTION", "Display Engine error",
         "display engine hardware or driver error; not logged by data-center GPUs since "
         "Ampere", _A.CONTACT_SUPPORT, "log"),
    _xid(57, "FB_LINK_TRAINING_FAILURE_ERROR", "Error programming video memory interface",
         "frame-buffer link training failed: driver, thermal or memory-interface hardware; "
         "not logged by data-center GPUs since Ampere", _A.CONTACT_SUPPORT, "crash"),
    _xid(61, "PMU_BREAKPOINT", "Internal micro-controller breakpoint/warning",
         "the GPU's internal micro-controller (PMU) hit a breakpoint, non-fatal; not logged "
         "by data-center GPUs since Ampere", _A.CONTACT_SUPPORT, "log"),
    _xid(62, "PMU_HALT_ERROR", "Internal micro-controller halt",
         "the GPU's internal micro-controller halted; firmware, driver or thermal",
         _A.RESET_GPU, "crash"),
    _xid(63, "INFOROM_DRAM_RETIREMENT_EVENT",
         "ECC page retirement or row remapping recording event",
         "a memory row was marked for remapping (A100+) or a page for retirement; it takes "
         "effect at the next GPU reset, so schedule one when the worker is drained",
         _A.IGNORE, "log", _NV_CATALOG + "; " + _NV_MEMORY),
    _xid(64, "INFOROM_DRAM_RETIREMENT_FAILURE",
         "ECC page retirement or row remapper recording failure",
         "remapping or retirement failed (no spare rows or InfoROM write failure); failing "
         "memory; reset the GPU, then contact support", _A.RESET_GPU, "crash",
         _NV_CATALOG + "; " + _NV_MEMORY),
    _xid(68, "ROBUST_CHANNEL_NVDEC0_ERROR", "NVDEC0 (video decoder) exception",
         "video decoder hardware or driver error", _A.RESTART_APP, "crash"),
    _xid(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "Graphics Engine class error",
         "an illegal class or method sent to the graphics engine; application or driver",
         _A.RESTART_APP, "crash"),
    _xid(74, "NVLINK_ERROR", "NVLink error",
         "an NVLink/NVSwitch link fault: a degraded link, seating or switch problem; the "
         "catalog action depends on the error bits (fatal ones need a GPU reset)",
         _A.RESET_GPU, "crash"),
    _xid(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus",
         "the GPU stopped answering on PCIe: hardware, power, thermal or bus fault",
         _A.RESTART_BM, "crash"),
    _xid(92, "EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate",
         "correctable errors above threshold; corrected by hardware, a rising rate predicts "
         "an uncorrectable one", _A.IGNORE, "log"),
    _xid(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "Contained ECC error",
         "an uncorrectable memory error contained to the application that touched it; "
         "other work continues, reset the GPU when drained to remap the row",
         _A.RESTART_APP, "request", _NV_CATALOG + "; " + _NV_MEMORY),
    _xid(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "Uncontained ECC error",
         "an uncorrectable memory error that could not be contained; every application on "
         "the GPU is affected", _A.RESET_GPU, "crash", _NV_CATALOG + "; " + _NV_MEMORY),
    _xid(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "Context switch timeout error",
         "a context switch did not finish in time: long-running kernels, application, "
         "driver or hardware", _A.RESET_GPU, "crash"),
    _xid(119, "GSP_RPC_TIMEOUT", "GSP RPC timeout",
         "the GPU System Processor (GSP firmware) did not answer a driver RPC in time",
         _A.RESET_GPU, "crash"),
    _xid(120, "GSP_ERROR", "GSP error",
         "the GPU System Processor (GSP firmware) reported an error", _A.RESET_GPU, "crash"),
    _xid(121, "C2C_ERROR", "C2C link corrected error",
         "a corrected error on the chip-to-chip (Grace-Hopper/Blackwell C2C) link; contact "
         "support if it recurs", _A.IGNORE, "log"),
    _xid(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC unrecovered error",
         "uncorrectable memory errors that kept the driver from offlining the page or "
         "remapping the row; reset, contact the vendor if it recurs",
         _A.RESET_GPU, "crash"),
    _xid(143, "GPU_INIT_ERROR", "GPU initialization error",
         "the GPU failed to initialize: firmware, driver or hardware", _A.RESET_GPU, "crash"),
    _xid(144, "NVLINK_SAW_ERROR", "NVLink SAW error",
         "NVLink error in the SAW block (Blackwell); the catalog action depends on severity",
         _A.RESET_GPU, "crash"),
    _xid(145, "NVLINK_RLW_ERROR", "NVLink RLW error",
         "NVLink error in the RLW block (Blackwell); the catalog action depends on severity",
         _A.RESET_GPU, "crash"),
    _xid(146, "NVLINK_TLW_ERROR", "NVLink TLW error",
         "NVLink error in the TLW block (Blackwell); the catalog action depends on severity",
         _A.RESET_GPU, "crash"),
    _xid(147, "NVLINK_TREX_ERROR", "NVLink TREX error",
         "NVLink error in the TREX block (Blackwell); the catalog action depends on severity",
         _A.RESET_GPU, "crash"),
    _xid(148, "NVLINK_NVLPW_CTRL_ERROR", "NVLink NVLPW control error",
         "NVLink error in the NVLPW control block (Blackwell); action depends on severity",
         _A.RESET_GPU, "crash"),
    _xid(149, "NVLINK_NETIR_ERROR", "NVLink NETIR error",
         "NVLink network error (NETIR, Blackwell NVL systems); action depends on severity",
         _A.RESET_GPU, "crash"),
    _xid(150, "NVLINK_MSE_ERROR", "NVLink MSE error",
         "NVLink management (MSE) error (Blackwell); the catalog action depends on severity",
         _A.RESET_GPU, "crash"),
    _xid(154, "GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed",
         "the driver states the recovery the GPU now needs (none, GPU reset, node reboot, "
         "drain P2P); the message names it and overrides this default",
         _A.RESET_GPU, "log"),
)

XID_CATALOG: Mapping[int, XidInfo] = MappingProxyType({row.code: row for row in _ROWS})

# Xid 154 messages name the recovery the driver wants, e.g.
# "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)".
_RECOVERY_TEXT: tuple[tuple[str, XidAction], ...] = (
    ("node reboot required", XidAction.RESTART_BM),
    ("drain and reset", XidAction.RESET_GPU),
    ("gpu reset required", XidAction.RESET_GPU),
    ("drain p2p", XidAction.RESTART_APP),
    ("(none)", XidAction.IGNORE),
)


def lookup_xid(code: int) -> XidInfo:
    """The catalog entry for `code`; `InvalidInput` names the known codes otherwise."""
    info = XID_CATALOG.get(code)
    if info is None:
        known = ", ".join(str(c) for c in sorted(XID_CATALOG))
        msg = (
            f"Xid {code} is not in ftctl's catalog of actionable Xids ({known}); "
            "see https://docs.nvidia.com/deploy/xid-errors/ for the full list"
        )
        raise InvalidInput(msg)
    return info


def action_for_message(code: int, message: str) -> XidAction:
    """The action for one logged event: the catalog's, refined by what the message says.

    Xid 154 carries the driver's own recovery action; other codes, and codes
    outside the catalog (CONTACT_SUPPORT: unknown to us means a human looks),
    keep their catalog action.
    """
    info = XID_CATALOG.get(code)
    if info is None:
        return XidAction.CONTACT_SUPPORT
    if code == 154:
        # Only the new state counts: "... from 0x2 (Node Reboot Required) to 0x0 (None)".
        lowered = message.lower().rpartition(" to ")[2]
        for text, action in _RECOVERY_TEXT:
            if text in lowered:
                return action
    return info.action
