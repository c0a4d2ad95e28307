"""Admission control: busy detection, degradation levels and priority shedding."""

from __future__ import annotations

import pytest

from dynamo_ftctl.proxy.admission import (
    BUSY_BODY,
    SHED_AT_LEVEL,
    RankLoad,
    Thresholds,
    WorkerLoad,
    decide,
    degradation_level,
    is_busy,
    parse_priority,
    parse_worker_load,
)

VLLM_DP = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.95
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.20
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
"""


def test_parse_worker_load_reads_each_data_parallel_rank() -> None:
    """KV usage and waiting requests are read per `engine` label."""
    load = parse_worker_load(VLLM_DP)
    assert load.ranks == (RankLoad(kv_usage=0.95, waiting=3), RankLoad(kv_usage=0.2, waiting=0))


def test_worker_with_one_free_rank_is_not_busy() -> None:
    """Data-parallel ranks make a worker busy only when every rank is busy."""
    load = parse_worker_load(VLLM_DP)
    assert not is_busy(load, Thresholds(active_decode_blocks_threshold=0.85))
    assert is_busy(load, Thresholds(active_decode_blocks_threshold=0.1))


def test_prefill_backlog_makes_a_worker_busy() -> None:
    """Pending prompt tokens, or waiting requests times the mean prompt, above the threshold."""
    quiet = WorkerLoad(ranks=(RankLoad(kv_usage=0.1, waiting=0),))
    limits = Thresholds(active_prefill_tokens_threshold=1000)
    assert not is_busy(quiet, limits, pending_prefill_tokens=1000)
    assert is_busy(quiet, limits, pending_prefill_tokens=1001)
    queued = WorkerLoad(ranks=(RankLoad(kv_usage=0.1, waiting=5),))
    assert is_busy(queued, limits, mean_prompt_tokens=300.0)
    assert not is_busy(queued, limits, mean_prompt_tokens=100.0)


def test_unscraped_worker_is_busy_only_by_its_own_backlog() -> None:
    """With no scrape yet, only the proxy's pending prefill count can make a worker busy."""
    assert not is_busy(None, Thresholds())
    assert is_busy(None, Thresholds(active_prefill_tokens_threshold=10), pending_prefill_tokens=11)


def test_parse_worker_load_reads_running_requests_and_the_pool_size() -> None:
    """num_requests_running per rank, and blocks x block size from vllm:cache_config_info."""
    text = VLLM_DP + (
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1024"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1024"} 1.0\n')
    load = parse_worker_load(text)
    assert [r.running for r in load.ranks] == [2, None]
    assert (load.pool_blocks, load.block_size) == (1024, 16)
    unsized = parse_worker_load('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n')
    assert (unsized.pool_blocks, unsized.block_size) == (0, 0)


def test_kv_of_a_rank_that_runs_nothing_is_not_load() -> None:
    """Full KV with nothing running or waiting (retained, cached) never makes a rank busy."""
    limits = Thresholds()
    idle = WorkerLoad(ranks=(RankLoad(kv_usage=0.99, waiting=0, running=0),))
    assert not is_busy(idle, limits)
    working = WorkerLoad(ranks=(RankLoad(kv_usage=0.99, waiting=0, running=1),))
    assert is_busy(working, limits)
    queueing = WorkerLoad(ranks=(RankLoad(kv_usage=0.99, waiting=2, running=0),))
    assert is_busy(queueing, limits)
    silent = WorkerLoad(ranks=(RankLoad(kv_usage=0.99, waiting=0),))  # no running metric
    assert is_busy(silent, limits)


def test_own_requests_move_the_scraped_kv_usage_until_the_next_scrape() -> None:
    """With the pool's size, the proxy's own blocks since the scrape count at once, both ways."""
    limits = Thresholds(active_decode_blocks_threshold=0.85)
    load = WorkerLoad(ranks=(RankLoad(kv_usage=0.5, waiting=0, running=3),), pool_blocks=1000)
    assert not is_busy(load, limits, kv_blocks=300, kv_blocks_at_scrape=300)
    assert is_busy(load, limits, kv_blocks=660, kv_blocks_at_scrape=300)
    assert not is_busy(load, limits, kv_blocks=0, kv_blocks_at_scrape=300)
    # The proxy's own share alone, with the scraped worker idle.
    idle = WorkerLoad(ranks=(RankLoad(kv_usage=0.0, waiting=0, running=0),), pool_blocks=1000)
    assert is_busy(idle, limits, kv_blocks=900, kv_blocks_at_scrape=900)
    # Two data-parallel ranks share the proxy's tokens; an unsized pool ignores them.
    two = WorkerLoad(ranks=(RankLoad(running=1), RankLoad(running=1)), pool_blocks=1000)
    assert not is_busy(two, limits, kv_blocks=1600)
    assert is_busy(two, limits, kv_blocks=1800)
    assert not is_busy(WorkerLoad(ranks=(RankLoad(running=1),)), limits, kv_blocks=10**6)


def test_garbage_metrics_text_is_an_error() -> None:
    """Text that is not Prometheus exposition raises ValueError (the scraper drops it)."""
    with pytest.raises(ValueError, match=r".+"):
        parse_worker_load("<html>{not metrics}</html>")


@pytest.mark.parametrize(("ratio", "level"), [
    (1.0, 0), (0.99, 1), (0.75, 1), (0.74, 2), (0.5, 2), (0.3, 3), (0.25, 3), (0.2, 4), (0.0, 4),
])
def test_degradation_level_from_healthy_capacity(ratio: float, level: int) -> None:
    """Levels 0-4 at >=1, >=0.75, >=0.5, >=0.25 and below."""
    assert degradation_level(ratio) == level


@pytest.mark.parametrize("level", range(5))
def test_priority_shedding_order_per_level(level: int) -> None:
    """best_effort is shed first, then standard; premium only when no worker can take it."""
    admitted = {p: decide(p, level, [False]).admitted
                for p in ("premium", "standard", "best_effort")}
    assert admitted["premium"]
    assert admitted["standard"] == (level < 3)
    assert admitted["best_effort"] == (level == 0)
    shed = SHED_AT_LEVEL[level]
    assert ("best_effort" in shed) >= ("standard" in shed)


def test_all_busy_refuses_all_but_premium() -> None:
    """When every worker is busy, standard and best_effort get all_workers_busy; premium queues."""
    for tier in ("standard", "best_effort"):
        decision = decide(tier, 0, [True, True])  # type: ignore[arg-type]
        assert not decision.admitted
        assert decision.reason == "all_workers_busy"
    assert decide("premium", 0, [True, True]).admitted
    assert decide("standard", 0, [True, False]).admitted
    assert decide("premium", 4, []).reason == "no_healthy_worker"


def test_premium_when_busy_shed_refuses_premium_too() -> None:
    """premium_when_busy=False (the proxy's `shed`) refuses every tier when all are busy."""
    decision = decide("premium", 0, [True, True], premium_when_busy=False)
    assert not decision.admitted
    assert decision.reason == "all_workers_busy"


def test_priority_header_parsing() -> None:
    """Known tiers are read case-insensitively; anything else is standard."""
    assert parse_priority("Premium") == "premium"
    assert parse_priority("best-effort") == "best_effort"
    assert parse_priority(None) == "standard"
    assert parse_priority("gold") == "standard"


def test_thresholds_are_validated() -> None:
    """A decode threshold outside [0, 1] or a negative token threshold is refused."""
    with pytest.raises(ValueError, match="within"):
        Thresholds(active_decode_blocks_threshold=1.5)
    with pytest.raises(ValueError, match="integer"):
        Thresholds(active_prefill_tokens_threshold=-1)


def test_busy_body_is_dynamos() -> None:
    """The body of a rejection is exactly the one the issue specifies."""
    assert BUSY_BODY == {
        "message": "Service temporarily unavailable: All workers are busy, please retry later",
        "type": "service_unavailable", "code": 503,
    }
