"""Merge the shares of one run (`--shard I/N`, `--procs N`) into one report.

Each share writes its own report directory (`summary.json`, `requests.jsonl`); the
merge reads every request back and summarizes them together, so percentiles are
exact over all samples (nearest rank over the union, to the microsecond the files
keep), never averages of per-shard percentiles. The shares must be of one run
(the same setup apart from the share) and together make one share of it or all of
it: 0/4 and 2/4 make 0/2; 0/4, 1/4 and 3/4 make nothing and are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from dynamo_ftctl.errors import InvalidInput, InventoryError
from dynamo_ftctl.jsoncodec import decode_fast
from dynamo_ftctl.loadgen.compare import load_report_json
from dynamo_ftctl.loadgen.config import (
    LoadConfig,
    Schedule,
    Shard,
    Slo,
    Workload,
    parse_length,
    parse_shard,
)
from dynamo_ftctl.loadgen.record import RequestRecord
from dynamo_ftctl.loadgen.runner import LoadReport
from dynamo_ftctl.loadgen.stats import summarize

__all__ = ["config_from_json", "merge_dirs", "merge_reports", "read_report_dir"]

# A line of requests.jsonl is a few hundred bytes; one of a megabyte is not one.
_MAX_LINE_BYTES = 1 << 20
_decode_row = decode_fast


def _ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000.0


def _record(row: dict[str, Any]) -> RequestRecord:
    return RequestRecord(
        index=int(row["index"]), target=str(row["target"]), planned=float(row["planned_s"]),
        sent=float(row["sent_s"]), done=float(row["done_s"]),
        first_token=None if row["first_token_s"] is None else float(row["first_token_s"]),
        output_tokens=int(row["output_tokens"]),
        itl=tuple(float(g) / 1000.0 for g in row.get("itl_ms") or ()),
        status=row["status"], outcome=str(row["outcome"]), migrated=int(row["migrated"]),
        warmup=bool(row["warmup"]), error=row["error"],
        server_ttft=_ms_to_s(row["server_ttft_ms"]), retry_after_s=row["retry_after_s"],
    )


def _read_records(path: Path) -> Iterator[RequestRecord]:
    try:
        with path.open("rb") as lines:
            for number, line in enumerate(lines, 1):
                if len(line) > _MAX_LINE_BYTES:
                    raise InventoryError("a line too long for a request", path=path,
                                         line=number)
                if not line.strip():
                    continue
                try:
                    yield _record(_decode_row(line))
                except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                    raise InventoryError(f"not a request row ({exc})", path=path,
                                         line=number) from None
    except OSError as exc:
        msg = f"{path}: cannot read the requests ({exc.strerror or exc})"
        raise InvalidInput(msg) from None


def config_from_json(doc: dict[str, Any], *, model: str | None = None) -> LoadConfig:
    """The `LoadConfig` a report's `config` section describes (`describe_config`'s inverse)."""
    sched = Schedule(
        rate=doc["rate_per_s"] if doc["loop"] == "open" else None, users=doc["users"],
        arrival=doc["arrival"] or "poisson", burstiness=doc["burstiness"],
        ramp_to=doc["ramp_to_per_s"], ramp_steps=doc["ramp_steps"],
        concurrency=doc["concurrency"], seed=doc["seed"],
        honor_retry_after=bool(doc.get("honor_retry_after", False)))  # older reports lack it
    wl = Workload(
        api=doc["api"], model=model, stream=doc["stream"],
        prompt_tokens=parse_length(doc["prompt_tokens"], what="prompt_tokens"),
        max_tokens=parse_length(doc["max_tokens"], what="max_tokens"),
        ignore_eos=doc["ignore_eos"], min_tokens=doc["min_tokens"], priority=doc["priority"],
        prompt_file=None if doc["prompt_file"] is None else Path(doc["prompt_file"]),
        trace=None if doc["trace"] is None else Path(doc["trace"]),
        conversations=doc.get("conversations"), turns=doc.get("turns", 4))  # older lack them
    return LoadConfig(
        targets=tuple(doc["targets"]), schedule=sched, workload=wl,
        duration_s=doc["duration_s"], requests=doc["requests"], warmup_s=doc["warmup_s"],
        timeout_s=doc["timeout_s"], abort_error_rate=doc["abort_error_rate"],
        slo=Slo(**doc["slo"]), spin_s=doc["spin_us"] / 1e6, client=doc["client"],
        shard=None if doc.get("shard") is None else parse_shard(doc["shard"]),
        start_at=doc.get("start_at"))


def read_report_dir(directory: Path) -> LoadReport:
    """A report written by `write_report` (`--out`), every request read back."""
    summary_path = directory / "summary.json"
    doc = load_report_json(summary_path)
    try:
        config = config_from_json(doc["config"], model=doc.get("model"))
        markers = tuple((float(m["t_s"]), str(m["label"])) for m in doc.get("markers") or ())
        started_at, elapsed = float(doc["started_at"]), float(doc["elapsed_s"])
        planned = int(doc["planned_requests"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InventoryError(f"not a whole load report ({exc})", path=summary_path,
                             key="config") from None
    records = tuple(_read_records(directory / "requests.jsonl"))
    summary = summarize(records, slo=config.slo, measure_from=config.warmup_s,
                        planned_requests=planned)
    return LoadReport(config=config, summary=summary, records=records, markers=markers,
                      started_at=started_at, elapsed_s=elapsed, model=doc.get("model"),
                      aborted=doc.get("aborted"))


def _union(shards: Sequence[Shard]) -> Shard | None:
    """The share that `shards` make together (None: the whole run); InvalidInput when
    they overlap or leave a hole."""
    counts = {s.count for s in shards}
    if len(counts) != 1:
        msg = f"merge: shards of different splits ({', '.join(map(str, shards))})"
        raise InvalidInput(msg)
    count = counts.pop()
    indices = sorted(s.index for s in shards)
    if len(set(indices)) != len(indices):
        msg = f"merge: a shard given twice ({', '.join(map(str, shards))})"
        raise InvalidInput(msg)
    if count % len(indices) == 0:
        step = count // len(indices)
        if indices == list(range(indices[0] % step, count, step)):
            return None if step == 1 else Shard(indices[0], step)
    missing = [f"{i}/{count}" for i in range(count) if i not in indices]
    msg = (f"merge: shards {', '.join(map(str, shards))} are not one share of the run "
           f"(missing: {', '.join(missing)})")
    raise InvalidInput(msg)


def merge_reports(reports: Sequence[LoadReport]) -> LoadReport:
    """One report of the shares of a run: every request, summarized together."""
    if not reports:
        msg = "merge: no reports"
        raise InvalidInput(msg)
    first = reports[0].config
    for report in reports:
        if report.config.shard is None:
            msg = "merge: a report of a whole run (no --shard) has nothing to merge with"
            raise InvalidInput(msg)
        if dataclasses.replace(report.config, shard=first.shard) != first:
            msg = (f"merge: shard {report.config.shard} ran another setup than shard "
                   f"{first.shard} (targets, schedule, workload and bounds must agree)")
            raise InvalidInput(msg)
    config = dataclasses.replace(
        first, shard=_union([r.config.shard for r in reports if r.config.shard is not None]))
    records = tuple(sorted((rec for r in reports for rec in r.records), key=lambda r: r.index))
    planned = sum(r.summary.planned_requests for r in reports)
    summary = summarize(records, slo=config.slo, measure_from=config.warmup_s,
                        planned_requests=planned)
    aborted = "; ".join(f"shard {r.config.shard}: {r.aborted}" for r in reports if r.aborted)
    return LoadReport(
        config=config, summary=summary, records=records,
        markers=tuple(sorted({m for r in reports for m in r.markers})),
        started_at=min(r.started_at for r in reports),
        elapsed_s=max(r.started_at + r.elapsed_s for r in reports)
        - min(r.started_at for r in reports),
        model=reports[0].model, aborted=aborted or None)


def merge_dirs(directories: Sequence[Path]) -> LoadReport:
    """`ftctl load merge DIR...`: the report directories of a run's shards, merged."""
    return merge_reports([read_report_dir(d) for d in directories])
