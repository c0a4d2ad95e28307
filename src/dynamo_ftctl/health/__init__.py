"""Canary checks, the EMA latency baseline, the worker state machine and the health daemon.

Public entry points (the CLI calls these; Python callers can too):
`load_canary_set`, `probe_workers` / `probe_worker` (one-shot), `record_canary_set`,
`WorkerHealth` (state machine + circuit breaker) and `run_daemon` (`--watch`).
Submodules import lazily so that `ftctl canary --worker w1` stays light.
"""

from __future__ import annotations

__all__: list[str] = []
