"""What the method measured: requests and tokens per load, cut streams, TTFT around the fault.

Drill loads ask for exactly `max_tokens` tokens (`ignore_eos`), so a completed
answer with fewer lost some and one with more repeated some. Witness streams
count as requests too; their own figures go under `witness`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynamo_ftctl.loadgen.record import SHED_STATUSES

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dynamo_ftctl.drill.scenario import LoadProfile
    from dynamo_ftctl.drill.witness import WitnessStream
    from dynamo_ftctl.loadgen.record import RequestRecord
    from dynamo_ftctl.loadgen.runner import LoadReport

__all__ = ["add_witness_counts", "cut_streams", "load_counts", "loads_counts", "ttft_split"]


def load_counts(report: LoadReport, max_tokens: int) -> dict[str, Any]:
    """Requests sent/failed/migrated/rejected and tokens lost/duplicated of a load run."""
    return _counts([(r, max_tokens) for r in report.records if not r.warmup])


def _counts(measured: list[tuple[RequestRecord, int]]) -> dict[str, Any]:
    ok = [(r, n) for r, n in measured if r.ok]
    lost = sum(max(0, n - r.output_tokens) for r, n in ok)
    duplicated = sum(max(0, r.output_tokens - n) for r, n in ok)
    shed = [r for r, _ in measured if r.status in SHED_STATUSES]
    return {"sent": len(measured), "completed": len(ok), "failed": len(measured) - len(ok),
            "migrated": sum(1 for r, _ in measured if r.migrated), "rejected": len(shed),
            "shed_with_retry_after": sum(1 for r in shed if r.retry_after_s is not None),
            "tokens_lost": lost, "tokens_duplicated": duplicated,
            "error_rate": (len(measured) - len(ok)) / len(measured) if measured else 0.0,
            "admitted_error_rate": (
                (len(measured) - len(ok) - len(shed)) / (len(measured) - len(shed))
                if len(measured) > len(shed) else 0.0)}


def loads_counts(runs: Sequence[tuple[LoadProfile, LoadReport]]) -> dict[str, Any]:
    """`load_counts` over every profile, and per priority (`by_priority`) when they differ."""
    measured = [(r, profile.max_tokens) for profile, report in runs
                for r in report.records if not r.warmup]
    counts = _counts(measured)
    if len(runs) > 1:
        counts["by_priority"] = {
            tier: _counts([(r, profile.max_tokens) for profile, report in runs
                           if (profile.priority or "standard") == tier
                           for r in report.records if not r.warmup])
            for tier in dict.fromkeys(profile.priority or "standard" for profile, _ in runs)
        }
    return counts


def add_witness_counts(counts: dict[str, Any], streams: list[WitnessStream],
                       max_tokens: int) -> None:
    """Witness streams count as requests too; their own figures go under `witness`."""
    from dynamo_ftctl.drill.witness import witness_counts

    seen = witness_counts(streams, max_tokens)
    counts["witness"] = seen
    for key in ("failed", "tokens_lost", "tokens_duplicated"):
        counts[key] += seen[key]
    counts["sent"] += seen["streams"]
    counts["completed"] += seen["streams"] - seen["failed"]
    counts["streams_cut"] = seen["cut"]
    counts["ids_mismatched"] = seen["ids_mismatched"]


def cut_streams(runs: Sequence[tuple[LoadProfile, LoadReport]],
                witness: dict[str, Any] | None) -> dict[str, int]:
    """Streams the proxy moved mid-generation, and how many of them continued intact.

    A witness stream is intact when its token ids equal the fault-free run's; a load
    stream (no ids) when it completed with exactly its `max_tokens` tokens.
    """
    moved = [(r, profile.max_tokens) for profile, report in runs
             for r in report.records if not r.warmup and r.migrated]
    complete = sum(1 for r, n in moved if r.ok and r.output_tokens == n)
    w_cut = (witness["cut"] + witness["cut_failed"]) if witness else 0
    w_intact = witness["cut_intact"] if witness else 0
    return {"streams": w_cut + len(moved), "continued_intact": w_intact + complete,
            "witness": w_cut, "witness_token_identical": w_intact,
            "load": len(moved), "load_complete": complete}


def ttft_split(records: list[RequestRecord] | None,
               first_fault: float | None) -> dict[str, Any]:
    """TTFT p50 and p99 of the whole load, and p99 before and after the first fault."""
    from dynamo_ftctl.loadgen.stats import percentile

    if records is None:
        return {}
    measured = [r for r in records if not r.warmup and r.ttft_s is not None]
    all_ms = [r.ttft_s * 1000 for r in measured if r.ttft_s is not None]
    before = [r.ttft_s * 1000 for r in measured
              if r.ttft_s is not None and (first_fault is None or r.planned < first_fault)]
    after = [r.ttft_s * 1000 for r in measured
             if r.ttft_s is not None and first_fault is not None and r.planned >= first_fault]

    def p(values: list[float], q: float) -> float | None:
        return round(percentile(sorted(values), q), 2) if values else None

    return {"ttft_p50_ms": p(all_ms, 50), "ttft_p99_ms": p(all_ms, 99),
            "ttft_p99_before_fault_ms": p(before, 99), "ttft_p99_after_fault_ms": p(after, 99)}
