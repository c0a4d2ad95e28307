"""The kernel-log Xid parser: real-format lines, fuzzed lines, PCI ids, followed files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.gpu.events import WorkerMap
from dynamo_ftctl.gpu.kmsg import (
    KmsgParser,
    KmsgWatcher,
    follow_file,
    parse_pci_map,
    parse_xid_line,
    pci_map_from_procfs,
)
from dynamo_ftctl.gpu.nvml import normalize_pci_bus_id
from dynamo_ftctl.xid import XidAction

# (line, xid, normalized bus id, pid, process): written from the documented formats.
CORPUS = [
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit "
     "error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
     48, "0000:3b:00", 1234, "python3"),
    ("[ 5107.644336] NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus.",
     79, "0000:03:00", None, None),
    ("Nov 22 18:29:55 hostname kernel: [  966.503025] NVRM: Xid (0000:01:00): 31, Ch 0000000b, "
     "engmask 00000120, intr 10000000", 31, "0000:01:00", None, None),
    ("NVRM: Xid (PCI:0000:65:00): 119, pid='N/A', Timeout waiting for RPC from GSP! Expected "
     "function 76 (GSP_RM_CONTROL)", 119, "0000:65:00", None, None),
    ("kernel: NVRM: NVRM: Xid (PCI:0000:3b:00): 94, pid=77, name=vllm, Contained: SM (0x1). "
     "RST: No, D-RST: No", 94, "0000:3b:00", 77, "vllm"),
    ("NVRM: Xid (PCI:3b:00): 48, pid=9, name=x, DBE", 48, "0000:3b:00", 9, "x"),
    ("6,1234,5678901,-;NVRM: Xid (PCI:0000:B3:00.0): 95, pid=42, name=sglang, Uncontained: "
     "FBHUB. RST: Yes, D-RST: No", 95, "0000:b3:00", 42, "sglang"),
    ("2024-05-01T10:00:00+0000 host kernel: NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row "
     "Remapper: New row marked for remapping, reset gpu to activate.", 63, "0000:10:1c", 1896,
     None),
    ("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
     "(GPU Reset Required)", 154, "0000:01:00", None, None),
    ("NVRM: Xid (PCI:0001:c1:00): 13, pid=5, name=app, Graphics SM Warp Exception on "
     "(GPC 0, TPC 1, SM 0): Out Of Range Address", 13, "0001:c1:00", 5, "app"),
    ("NVRM: Xid (PCI:0000:3b:00): 43, pid=<unknown>, name=<unknown>, Ch 00000010",
     43, "0000:3b:00", None, "<unknown>"),
]

NOT_XID = [
    "",
    "\n",
    "usbhid 2-3:1.0: suspend error -5",
    "NVRM: GPU at PCI:0000:2b:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV",
    "some app logged the word Xid in passing",
]

MALFORMED = [
    "NVRM: Xid (PCI:zzzz): 48, broken",
    "NVRM: Xid (PCI:0000:3b:00): , no code",
    "NVRM: Xid",
]


@pytest.mark.parametrize(("line", "xid", "bus", "pid", "process"), CORPUS)
def test_corpus_lines_parse(line: str, xid: int, bus: str, pid: int | None,
                            process: str | None) -> None:
    """Every documented variant yields the Xid, the normalized bus id, pid and process."""
    found = parse_xid_line(line)
    assert found is not None
    assert found.xid == xid
    assert found.pci_bus_id == bus
    assert found.pid == pid
    assert found.process == process
    assert found.raw == line
    assert found.message


@pytest.mark.parametrize("line", NOT_XID + MALFORMED)
def test_other_lines_give_nothing(line: str) -> None:
    """Non-Xid lines (SXid included) and malformed Xid lines give None."""
    assert parse_xid_line(line) is None


def test_parser_counts_lines_xids_and_malformed() -> None:
    """Malformed NVRM Xid lines are skipped and counted; SXid and other lines are not."""
    parser = KmsgParser()
    lines = [c[0] for c in CORPUS] + NOT_XID + MALFORMED
    found = list(parser.parse_lines(lines))
    assert [f.xid for f in found] == [c[1] for c in CORPUS]
    assert parser.lines == len(lines)
    assert parser.xids == len(CORPUS)
    assert parser.malformed == len(MALFORMED)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
def test_fuzzed_text_never_raises(text: str) -> None:
    """Arbitrary text never makes the parser raise."""
    parser = KmsgParser()
    list(parser.parse_lines(text.splitlines() or [text]))
    parse_xid_line(text)


@settings(max_examples=400, deadline=None)
@given(
    prefix=st.text(max_size=40),
    bus=st.text(alphabet="0123456789abcdefABCDEF:.xyz", max_size=16),
    code=st.text(alphabet="0123456789 ,-x", max_size=8),
    rest=st.text(max_size=80),
    doubled=st.booleans(),
)
def test_fuzzed_xid_shaped_lines_never_raise(
    prefix: str, bus: str, code: str, rest: str, doubled: bool,
) -> None:
    """Lines shaped like Xid lines with random parts parse or are skipped, never raise."""
    nvrm = "NVRM: NVRM: " if doubled else "NVRM: "
    line = f"{prefix}{nvrm}Xid (PCI:{bus}): {code}, {rest}"
    found = parse_xid_line(line)
    if found is not None:
        assert 0 <= found.xid < 100_000
    parser = KmsgParser()
    list(parser.parse_lines([line]))
    assert parser.xids + parser.malformed <= 1


@pytest.mark.parametrize(
    ("given_id", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),
        ("0000:3b:00", "0000:3b:00"),
        ("PCI:3b:00", "0000:3b:00"),
        ("0001:C1:00.0", "0001:c1:00"),
        ("nonsense", None),
        ("", None),
    ],
)
def test_pci_ids_normalize(given_id: str, expected: str | None) -> None:
    """NVML's and the kernel's spellings of a bus id meet in one form."""
    assert normalize_pci_bus_id(given_id) == expected


def test_pci_map_flag() -> None:
    """--pci-map parses BUS=INDEX pairs and names a bad item."""
    assert parse_pci_map("0000:3b:00=0, 00000000:86:00.0=1") == {
        "0000:3b:00": 0, "0000:86:00": 1,
    }
    with pytest.raises(InvalidInput, match="BUS_ID=INDEX"):
        parse_pci_map("3b:00")


def test_pci_map_from_procfs(tmp_path: Path) -> None:
    """The driver's procfs maps bus ids to device minors when NVML is absent."""
    gpu = tmp_path / "0000:3b:00.0"
    gpu.mkdir()
    (gpu / "information").write_text("Model: \t NVIDIA H100\nDevice Minor: \t 3\n")
    (tmp_path / "junk").mkdir()
    assert pci_map_from_procfs(tmp_path) == {"0000:3b:00": 3}
    assert pci_map_from_procfs(tmp_path / "missing") == {}


class _Inv:
    def __init__(self, workers: list[tuple[str, str, tuple[int, ...]]]) -> None:
        self.workers = [_W(*w) for w in workers]


class _W:
    def __init__(self, name: str, node: str, gpus: tuple[int, ...]) -> None:
        self.name, self.node, self.gpus = name, node, gpus


def test_watcher_maps_bus_ids_to_workers() -> None:
    """A kernel-log Xid 48 names the GPU index and the worker on it, with RESET_GPU."""
    workers = WorkerMap(_Inv([("w1", "node-a", (0, 1)), ("w2", "node-a", (2, 3)),
                              ("w3", "node-b", (0,))]))
    watcher = KmsgWatcher(node="node-a", clock=FakeClock(), workers=workers,
                          pci_map={"0000:3b:00": 2, "0000:86:00": 0})
    events = list(watcher.events([CORPUS[0][0], "noise", CORPUS[5][0]]))
    assert [e.gpu for e in events] == [2, 2]
    assert events[0].workers == ("w2",)
    assert events[0].action is XidAction.RESET_GPU
    assert events[0].source == "kmsg"
    assert events[0].details["pid"] == 1234
    assert events[0].reason.startswith("xid 48: Double Bit ECC Error")


def test_unmapped_bus_id_names_the_whole_node() -> None:
    """Without a PCI map the event keeps the bus id and names every worker of the node."""
    workers = WorkerMap(_Inv([("w1", "node-a", (0,)), ("w2", "node-a", (1,))]))
    watcher = KmsgWatcher(node="node-a", clock=FakeClock(), workers=workers)
    (event,) = watcher.events([CORPUS[1][0]])
    assert event.gpu is None
    assert event.pci_bus_id == "0000:03:00"
    assert event.workers == ("w1", "w2")
    assert event.action is XidAction.RESTART_BM


def test_follow_file_reads_appended_lines_and_waits_for_newlines(tmp_path: Path) -> None:
    """A followed file yields its lines, then appended ones; partial lines wait."""
    log = tmp_path / "kern.log"
    log.write_text("one\n")
    clock = FakeClock()
    writes = iter(["two\nthr", "ee\n", None])

    def stop() -> bool:
        chunk = next(writes)
        if chunk is None:
            return True
        with log.open("a") as handle:
            handle.write(chunk)
        return False

    lines = list(follow_file(log, clock=clock, poll_s=0.01, stop=stop))
    assert lines == ["one\n", "two\n", "three\n"]
    assert clock.sleeps == [0.01, 0.01]


def test_follow_file_reopens_after_rotation(tmp_path: Path) -> None:
    """A truncated or replaced file is read again from its start (tail -F)."""
    log = tmp_path / "kern.log"
    log.write_text("old line one\nold line two\n")
    steps = iter(["rotate", "stop"])

    def stop() -> bool:
        if next(steps) == "stop":
            return True
        log.unlink()
        log.write_text("new\n")
        return False

    lines = list(follow_file(log, clock=FakeClock(), stop=stop))
    assert lines == ["old line one\n", "old line two\n", "new\n"]


def test_missing_file_is_invalid_input(tmp_path: Path) -> None:
    """A --source file that cannot be read exits 2 with its path."""
    with pytest.raises(InvalidInput, match=r"nope\.log"):
        list(follow_file(tmp_path / "nope.log", clock=FakeClock(), follow=False))


def test_journal_lines_reads_journalctl_and_stops_it(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`--source journal`: journalctl -k's lines in order; a follow that is closed stops
    journalctl (no process left behind)."""
    from dynamo_ftctl.gpu.kmsg import journal_lines
    from dynamo_ftctl.process import Identity

    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "journalctl"
    script.write_text("#!/bin/sh\necho $$ > \"$0.pid\"\nprintf 'one\\ntwo\\n'\n"
                      "case \" $* \" in *' -f '*) exec sleep 60 ;; esac\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    assert list(journal_lines(follow=False)) == ["one\n", "two\n"]
    follow = journal_lines(follow=True)
    assert next(follow) == "one\n"
    pid = int((bindir / "journalctl.pid").read_text())
    running = Identity.of(pid)
    assert running is not None
    follow.close()
    assert not running.alive
