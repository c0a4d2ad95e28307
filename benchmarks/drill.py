"""Figures of issue 11: the worker-crash drill and the time from xid48 to drained.

Runs, on a local cluster (`ftctl drill --local`: 3 ftctl sim workers, the
migrating proxy, the canary daemon), each of these `--runs` times and prints
the median:

- baseline: drills/worker-crash.yaml with its fault removed (same load, same
  seed) — TTFT p99 *without* the fault, measured in the same run;
- worker-crash: requests sent, failed, migrated, tokens lost/duplicated, TTFT
  p99 with the fault, and its ratio to the baseline;
- xid48: seconds from `inject xid48` to the canary daemon setting the worker's
  weight to 0 (passive path: the proxy's failure report, then a confirming probe);
- overload: premium, standard and best_effort loads at once through the proxy;
  per priority: requests sent, failed, shed (503) and shed with Retry-After.

    python benchmarks/drill.py [--runs 3]

The machine is shared and has 2 cores: latencies are noisy; read the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from dynamo_ftctl.drill import run_drill

DRILLS = Path(__file__).resolve().parents[1] / "drills"


def _baseline_scenario(folder: Path) -> Path:
    """worker-crash.yaml with the kill replaced by a probe at the same offset."""
    doc: dict[str, Any] = yaml.safe_load((DRILLS / "worker-crash.yaml").read_text())
    doc["title"] = "worker crash baseline (no fault)"
    doc["inventory"] = str(DRILLS / doc["inventory"])
    at = doc["method"]["timeline"][0]["at_s"]
    doc["method"]["timeline"] = [{"at_s": at, "probe": {"name": "up",
                                                         "kind": "workers_healthy"}}]
    path = folder / "baseline.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[Any]] = {k: [] for k in (
        "sent", "failed", "migrated", "tokens_lost", "tokens_duplicated", "p99_base",
        "p99_fault", "p99_after", "drained", "passed")}
    tiers: dict[str, dict[str, list[Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="ftctl-bench-drill-") as tmp:
        folder = Path(tmp)
        baseline = _baseline_scenario(folder)
        for run in range(args.runs):
            base = run_drill(baseline, local=True, out_dir=folder / f"base{run}", plot=False)
            crash = run_drill(DRILLS / "worker-crash.yaml", local=True,
                              out_dir=folder / f"crash{run}", plot=False)
            xid = run_drill(DRILLS / "xid48.yaml", local=True, out_dir=folder / f"xid{run}",
                            plot=False)
            for key in ("sent", "failed", "migrated", "tokens_lost", "tokens_duplicated"):
                rows[key].append(crash.counts[key])
            rows["p99_base"].append(base.latency["ttft_p99_ms"])
            rows["p99_fault"].append(crash.latency["ttft_p99_ms"])
            rows["p99_after"].append(crash.latency["ttft_p99_after_fault_ms"])
            rows["drained"].append(xid.detections.get("xid48 w1"))
            over = run_drill(DRILLS / "overload.yaml", local=True,
                             out_dir=folder / f"overload{run}", plot=False)
            for tier, counts in over.counts.get("by_priority", {}).items():
                for key in ("sent", "failed", "rejected", "shed_with_retry_after"):
                    tiers.setdefault(tier, {}).setdefault(key, []).append(counts[key])
            rows["passed"].append(crash.passed and xid.passed and base.passed and over.passed)
            print(f"run {run + 1}: crash {crash.counts} p99 {crash.latency['ttft_p99_ms']} ms "
                  f"(baseline {base.latency['ttft_p99_ms']} ms); xid48 drained after "
                  f"{xid.detections.get('xid48 w1')} s", file=sys.stderr)
    m = {k: _median(v) for k, v in rows.items() if k != "passed"}
    ratio = (m["p99_fault"] / m["p99_base"]) if m["p99_base"] and m["p99_fault"] else None
    print(f"worker-crash drill, median of {args.runs} runs (kill 1 of 3 workers mid-load, "
          "6 req/s Poisson, 256 streamed tokens each, via the migrating proxy):")
    print(f"  requests sent {m['sent']:.0f}, failed {m['failed']:.0f} (goal 0), migrated "
          f"{m['migrated']:.0f}")
    print(f"  tokens lost {m['tokens_lost']:.0f}, duplicated {m['tokens_duplicated']:.0f} "
          "(goal 0)")
    print(f"  TTFT p99 without the fault {m['p99_base']:.0f} ms, with it "
          f"{m['p99_fault']:.0f} ms (x{ratio:.2f}); requests sent after the kill: "
          f"{m['p99_after']:.0f} ms" if ratio else "  TTFT: no measurement")
    drained = m["drained"]
    print("xid48 -> worker drained by the canary daemon (passive path), median: "
          + (f"{drained:.3f} s (goal <= 1 s)" if drained is not None else "not drained"))
    print(f"overload drill, median of {args.runs} runs (premium 2 + standard 20 + best_effort "
          "60 req/s for 8 s through the proxy):")
    for tier, counts in tiers.items():
        t = {k: _median(v) for k, v in counts.items()}
        print(f"  {tier:11}: sent {t['sent']:.0f}, failed {t['failed']:.0f}, shed "
              f"{t['rejected']:.0f} ({t['shed_with_retry_after']:.0f} with Retry-After)")
    print(f"  every drill passed: {all(rows['passed'])}")
    return 0 if all(rows["passed"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
