"""Load generation for LLM endpoints: open-loop arrivals timed from their planned send.

The public face: build a `LoadConfig` (targets, `Schedule`, `Workload`, bounds,
`Slo`) and call `run_load` (or `run_load_async` inside an event loop) for a
`LoadReport`; `sweep_rate` finds the highest rate meeting an SLO;
`write_report` saves CSV/JSONL/PNG; `compare_reports` diffs two saved runs.
`run_load_processes` runs one plan in N forked processes; a `Shard` of the config
runs one share of it (on another machine too, from a common `start_at`), and
`merge_dirs`/`merge_reports` merge the shares' samples into one report.
Submodules load httptools and matplotlib only when a run or a plot
needs them.
"""

from dynamo_ftctl.loadgen.compare import Comparison, compare_reports
from dynamo_ftctl.loadgen.config import (
    Length,
    LoadConfig,
    Schedule,
    Shard,
    Slo,
    Workload,
    parse_duration,
    parse_length,
    parse_shard,
    parse_start_at,
)
from dynamo_ftctl.loadgen.export import report_paths, write_report
from dynamo_ftctl.loadgen.merge import merge_dirs, merge_reports, read_report_dir
from dynamo_ftctl.loadgen.processes import run_load_processes
from dynamo_ftctl.loadgen.record import RequestRecord
from dynamo_ftctl.loadgen.runner import LoadEvent, LoadReport, Progress, run_load, run_load_async
from dynamo_ftctl.loadgen.stats import Distribution, LoadSummary
from dynamo_ftctl.loadgen.sweep import SweepReport, sweep_rate, sweep_rate_async

__all__ = [
    "Comparison",
    "Distribution",
    "Length",
    "LoadConfig",
    "LoadEvent",
    "LoadReport",
    "LoadSummary",
    "Progress",
    "RequestRecord",
    "Schedule",
    "Shard",
    "Slo",
    "SweepReport",
    "Workload",
    "compare_reports",
    "merge_dirs",
    "merge_reports",
    "parse_duration",
    "parse_length",
    "parse_shard",
    "parse_start_at",
    "read_report_dir",
    "report_paths",
    "run_load",
    "run_load_async",
    "run_load_processes",
    "sweep_rate",
    "sweep_rate_async",
    "write_report",
]
