"""The latency baseline: an EMA of each worker's canary latency, kept in a state file.

A latency spike is a probe slower than `factor` x the worker's EMA baseline.
One-shot probes (Kubernetes runs one process per probe) share the baseline
through a JSON state file, by default `$XDG_STATE_HOME/ftctl/canary.json`.
Concurrent probes must not corrupt it: every read-modify-write holds an
exclusive `flock` on a sibling `.lock` file (the data file itself is replaced
by `write_atomic`, so a lock on it would be a lock on a file about to vanish).

Rules: no verdict before `MIN_SAMPLES` healthy probes; a spike must also be at
least `MIN_SPIKE_S` slower than the baseline (loopback jitter on a busy host
easily triples a 5 ms probe); spikes and failures do not feed the EMA, so a
worker that turned slow stays flagged instead of becoming the new normal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import msgspec

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.jsoncodec import loads

__all__ = [
    "MIN_SAMPLES",
    "MIN_SPIKE_S",
    "Baseline",
    "BaselineStore",
    "Baselines",
    "LatencyVerdict",
    "default_state_file",
]

MIN_SAMPLES = 3
MIN_SPIKE_S = 0.05
_VERSION = 1
# About 60 bytes a worker: 16 MiB is far past any fleet, and bounds what a probe reads.
_MAX_STATE_BYTES = 16 * 1024 * 1024


def default_state_file() -> Path:
    """`$XDG_STATE_HOME/ftctl/canary.json` (XDG default: ~/.local/state)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ftctl" / "canary.json"


class Baseline(msgspec.Struct, frozen=True):
    """One worker's EMA latency and how many probes built it."""

    ema_s: float
    samples: int


class LatencyVerdict(msgspec.Struct, frozen=True):
    """What one probe's latency says against the baseline it met."""

    latency_s: float
    baseline_s: float | None
    samples: int
    spike: bool
    factor: float

    @property
    def reason(self) -> str:
        """One line for the probe result."""
        if self.baseline_s is None:
            return f"latency {self.latency_s * 1000:.0f} ms (baseline building)"
        ratio = self.latency_s / self.baseline_s if self.baseline_s > 0 else float("inf")
        return (f"latency spike: {self.latency_s * 1000:.0f} ms is {ratio:.1f}x the baseline "
                f"{self.baseline_s * 1000:.0f} ms (limit {self.factor:g}x)")


class Baselines:
    """Baselines by worker key, in memory (the daemon holds one; the store loads one)."""

    def __init__(self, entries: Mapping[str, Baseline] | None = None) -> None:
        self.entries: dict[str, Baseline] = dict(entries or {})

    def judge(self, key: str, latency_s: float, factor: float) -> LatencyVerdict:
        """Is `latency_s` a spike against `key`'s baseline?"""
        entry = self.entries.get(key)
        if entry is None or entry.samples < MIN_SAMPLES:
            return LatencyVerdict(latency_s, None, entry.samples if entry else 0, False, factor)
        spike = latency_s > factor * entry.ema_s and latency_s - entry.ema_s > MIN_SPIKE_S
        return LatencyVerdict(latency_s, entry.ema_s, entry.samples, spike, factor)

    def update(self, key: str, latency_s: float, alpha: float) -> Baseline:
        """Fold a healthy probe's latency into the EMA (the first sample seeds it)."""
        entry = self.entries.get(key)
        if entry is None:
            new = Baseline(latency_s, 1)
        else:
            new = Baseline(alpha * latency_s + (1 - alpha) * entry.ema_s, entry.samples + 1)
        self.entries[key] = new
        return new

    def to_json(self) -> dict[str, object]:
        """The state file's document."""
        return {"version": _VERSION, "workers": {
            k: {"ema_s": v.ema_s, "samples": v.samples} for k, v in sorted(self.entries.items())
        }}

    @classmethod
    def from_json(cls, doc: object) -> Baselines:
        """Parse a state file document; unusable entries are dropped (it is only a cache)."""
        entries: dict[str, Baseline] = {}
        workers = doc.get("workers") if isinstance(doc, dict) else None
        if isinstance(workers, dict):
            for key, value in workers.items():
                if not isinstance(value, dict):
                    continue
                ema, samples = value.get("ema_s"), value.get("samples")
                if isinstance(ema, int | float) and isinstance(samples, int) and ema >= 0:
                    entries[str(key)] = Baseline(float(ema), samples)
        return cls(entries)


class BaselineStore:
    """The state file, read and written under an exclusive flock."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_state_file()
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def _open_lock(self) -> int:
        try:
            from dynamo_ftctl.safefiles import check_output_path, open_regular

            check_output_path(self.path)  # a FIFO would block the read: refused, exit 2
            return open_regular(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            msg = f"{self.path}: cannot open the canary state file: {exc.strerror or exc}"
            raise InvalidInput(msg) from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[Baselines]:
        """Hold the lock, yield the baselines, write them back on a clean exit."""
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            baselines = self._read()
            yield baselines
            from dynamo_ftctl.output import write_atomic

            write_atomic(self.path, json.dumps(baselines.to_json(), indent=1) + "\n")
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def load(self) -> Baselines:
        """A snapshot of the baselines (under a shared lock: never a half-updated view)."""
        if not self.path.exists():
            return Baselines()
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return self._read()
        finally:
            os.close(fd)

    def merge(self, baselines: Baselines) -> None:
        """Write `baselines` over the stored ones (the daemon, once per interval)."""
        with self.locked() as stored:
            stored.entries.update(baselines.entries)

    def _read(self) -> Baselines:
        try:
            with self.path.open("rb") as handle:
                raw = handle.read(_MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return Baselines()
        except OSError as exc:
            msg = f"{self.path}: cannot read the canary state file: {exc.strerror or exc}"
            raise InvalidInput(msg) from None
        if len(raw) > _MAX_STATE_BYTES:
            return Baselines()  # a cache: a damaged one is rebuilt, not fatal
        try:
            return Baselines.from_json(loads(raw))
        except (ValueError, RecursionError):
            return Baselines()
