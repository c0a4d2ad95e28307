"""The generator against a real `ftctl sim` engine: exact token counts, streamed timings."""

from __future__ import annotations

import pytest

from dynamo_ftctl.loadgen import Length, LoadConfig, Schedule, Workload, run_load

pytestmark = pytest.mark.integration


def test_streamed_load_against_sim(shared_sim_worker):
    """Streaming against ftctl sim: every request completes with the asked token count,
    TTFT and ITL are measured, and no error is recorded."""
    report = run_load(LoadConfig(
        targets=(shared_sim_worker.url,), schedule=Schedule(rate=10, arrival="constant"),
        workload=Workload(stream=True, prompt_tokens=Length.fixed(16),
                          max_tokens=Length.fixed(8), ignore_eos=True),
        requests=10, timeout_s=60))
    s = report.summary
    assert s.errors_by_class == {}, [r.error for r in report.records if not r.ok]
    assert s.completed == 10
    assert all(r.output_tokens == 8 for r in report.records)
    assert s.ttft_ms.count == 10
    assert s.itl_ms.count > 0
    assert report.model is not None
