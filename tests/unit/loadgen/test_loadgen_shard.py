"""Shares of one run: the plan split by request number, a common start, exact merges."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from tests.unit.loadgen.test_loadgen_runner import FakeSender

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.loadgen.config import (
    LoadConfig,
    Schedule,
    Shard,
    Slo,
    parse_shard,
    parse_start_at,
)
from dynamo_ftctl.loadgen.export import write_report
from dynamo_ftctl.loadgen.merge import config_from_json, merge_reports, read_report_dir
from dynamo_ftctl.loadgen.runner import LoadReport, describe_config, run_load_async
from dynamo_ftctl.loadgen.stats import summarize

OPEN = LoadConfig(targets=("http://a", "http://b"),
                  schedule=Schedule(rate=50, arrival="poisson", seed=7), duration_s=2.0,
                  warmup_s=0.2, slo=Slo(ttft_p99_ms=100))


def _run(config: LoadConfig, clock: FakeClock | None = None) -> tuple[LoadReport, FakeSender]:
    clock = clock or FakeClock()
    sender = FakeSender(clock)
    return asyncio.run(run_load_async(config, clock=clock, sender=sender)), sender


def _shares(config: LoadConfig, count: int) -> list[LoadReport]:
    return [_run(dataclasses.replace(config, shard=Shard(i, count)))[0] for i in range(count)]


def test_shares_send_the_whole_plan_once():
    """The shards of an open-loop run send exactly one process's requests, at its times."""
    whole, whole_sender = _run(OPEN)
    shares = _shares(OPEN, 3)
    sent = sorted((r.index, r.planned) for s in shares for r in s.records)
    assert sent == [(r.index, r.planned) for r in whole.records]
    assert [r.index for r in shares[1].records] == list(range(1, len(whole.records), 3))
    assert sum(s.summary.planned_requests for s in shares) == whole.summary.planned_requests
    bodies = {spec.index: spec.body for spec in whole_sender.specs}
    _, sender = _run(dataclasses.replace(OPEN, shard=Shard(2, 3)))
    assert all(spec.body == bodies[spec.index] for spec in sender.specs)


def test_merged_shares_equal_one_run():
    """Merging the shards' reports gives one process's requests and counts (on the fake
    clock answers come when the next arrival moves time, so only send times agree)."""
    whole, _ = _run(OPEN)
    merged = merge_reports(_shares(OPEN, 4))
    assert merged.config == OPEN
    assert ([(r.index, r.planned, r.sent, r.warmup) for r in merged.records]
            == [(r.index, r.planned, r.sent, r.warmup) for r in whole.records])
    for name in ("planned_requests", "completed", "failed", "queue_ms"):
        assert getattr(merged.summary, name) == getattr(whole.summary, name), name


def test_merged_percentiles_come_from_samples_not_averages():
    """A p99 over merged samples is the union's nearest rank, not a mean of the shards'."""
    # Shard 0 slow, shard 1 fast: shift shard 0's answers by 1 s.
    shards = []
    for i in range(2):
        share, _ = _run(dataclasses.replace(OPEN, shard=Shard(i, 2)))
        if i == 0:
            records = tuple(dataclasses.replace(r, done=r.done + 1.0, first_token=r.done + 1.0)
                            for r in share.records)
            share = dataclasses.replace(share, records=records, summary=summarize(
                records, slo=OPEN.slo, measure_from=OPEN.warmup_s,
                planned_requests=share.summary.planned_requests))
        shards.append(share)
    merged = merge_reports(shards)
    samples = sorted(r.e2e_s * 1000 for r in merged.records if not r.warmup)
    assert merged.summary.e2e_ms.p50 == samples[(len(samples) + 1) // 2 - 1]
    mean_of_p50 = (shards[0].summary.e2e_ms.p50 + shards[1].summary.e2e_ms.p50) / 2
    assert merged.summary.e2e_ms.p50 != pytest.approx(mean_of_p50)
    assert merged.summary.slo_met is False


def test_closed_loop_shares_split_users_and_request_numbers():
    """Closed loop: each shard takes every N-th request number and an N-th of the users."""
    config = LoadConfig(targets=("http://a",), schedule=Schedule(users=5), requests=40)
    shares = _shares(config, 2)
    assert sorted(r.index for s in shares for r in s.records) == list(range(40))
    assert {r.index % 2 for r in shares[1].records} == {1}
    assert Shard(0, 2).users(5) == 3
    assert Shard(1, 2).users(5) == 2
    with pytest.raises(InvalidInput, match="users cannot be shared"):
        LoadConfig(targets=("http://a",), schedule=Schedule(users=1), requests=4,
                   shard=Shard(0, 2))


def test_start_at_waits_for_the_wall_clock():
    """A run with `start_at` begins when the wall clock reads it, not before."""
    clock = FakeClock()
    start = clock.wall() + 30.0
    report, _ = _run(dataclasses.replace(OPEN, start_at=start), clock)
    assert report.started_at == pytest.approx(start)


def test_merge_refuses_holes_overlaps_and_other_setups():
    """Shards that leave a hole, repeat one, or ran another setup are not merged."""
    shares = _shares(OPEN, 4)
    assert merge_reports([shares[0], shares[2]]).config.shard == Shard(0, 2)
    with pytest.raises(InvalidInput, match=r"missing: 2/4"):
        merge_reports([shares[0], shares[1], shares[3]])
    with pytest.raises(InvalidInput, match="twice"):
        merge_reports([shares[0], shares[0]])
    other = _run(dataclasses.replace(OPEN, shard=Shard(1, 2), duration_s=1.0))[0]
    with pytest.raises(InvalidInput, match="another setup"):
        merge_reports([_shares(OPEN, 2)[0], other])
    with pytest.raises(InvalidInput, match="whole run"):
        merge_reports([_run(OPEN)[0]])


def test_report_directories_round_trip(tmp_path: Path):
    """A shard written with `write_report` reads back with its config and samples."""
    share = _run(dataclasses.replace(OPEN, shard=Shard(1, 2), start_at=1.7e9))[0]
    write_report(share, tmp_path / "s1", plot=False)
    back = read_report_dir(tmp_path / "s1")
    assert back.config == share.config
    assert [r.index for r in back.records] == [r.index for r in share.records]
    assert back.summary.planned_requests == share.summary.planned_requests
    assert back.records[3].planned == pytest.approx(share.records[3].planned, abs=1e-6)
    assert config_from_json(describe_config(OPEN)) == OPEN


def test_read_report_dir_names_a_bad_line(tmp_path: Path):
    """A forged requests.jsonl fails with the file and line, not a traceback."""
    share = _run(dataclasses.replace(OPEN, shard=Shard(0, 2)))[0]
    write_report(share, tmp_path, plot=False)
    (tmp_path / "requests.jsonl").write_text('{"index": 0}\nnot json\n')
    with pytest.raises(InvalidInput, match=r"requests.jsonl:1: not a request row"):
        read_report_dir(tmp_path)


@pytest.mark.parametrize(("text", "shard"), [("0/1", Shard(0, 1)), (" 3 / 4 ", Shard(3, 4))])
def test_parse_shard(text: str, shard: Shard):
    """I/N parses to a 0-based shard."""
    assert parse_shard(text) == shard


@pytest.mark.parametrize("text", ["4/4", "1", "-1/2", "a/b", "1/0"])
def test_parse_shard_refuses(text: str):
    """An index outside 0..N-1 or not I/N is bad input."""
    with pytest.raises(InvalidInput, match="--shard"):
        parse_shard(text)


def test_parse_start_at():
    """Epoch seconds and ISO 8601 with a zone are read; a zoneless time is refused."""
    assert parse_start_at("1767225600.5") == 1767225600.5
    assert parse_start_at("2026-01-01T00:00:00Z") == 1767225600.0
    assert parse_start_at("2026-01-01T01:00:00+01:00") == 1767225600.0
    for bad in ("2026-01-01T00:00:00", "soon", "nan", "-5"):
        with pytest.raises(InvalidInput, match="--start-at"):
            parse_start_at(bad)


def test_shard_split_composes():
    """Share j of P of shard I/N is shard I + N*j of N*P."""
    assert Shard(1, 2).split(3, 2) == Shard(5, 6)
    assert Shard(0, 1).split(2, 1) == Shard(1, 2)
