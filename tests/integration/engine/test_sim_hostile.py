"""`ftctl sim serve` against hostile bodies and bytes: strict JSON (depth, NaN), and
fuzzing that must never get a 500 or take the engine down."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests import hostile

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration
MODEL = "ftctl-sim-tiny"


def _port(worker: SimWorker) -> int:
    return int(worker.url.rsplit(":", 1)[1])


@pytest.mark.parametrize(("data", "reason"), [
    (b"[" * 100_000, b"nested deeper than 64"),
    (b'{"model": "ftctl-sim-tiny", "prompt": "hi", "max_tokens": NaN}',
     b"NaN is not a JSON number"),
    (b'{"prompt": "hi", "temperature": Infinity}', b"Infinity is not a JSON number"),
])
def test_deep_or_non_finite_json_is_a_400(shared_sim_worker: SimWorker, data: bytes,
                                           reason: bytes) -> None:
    """100k nested `[` and NaN/Infinity get the engine's 400, never a 500."""
    answer = hostile.exchange(_port(shared_sim_worker), hostile.post("/v1/completions", data))
    assert hostile.status_of(answer) == 400, answer[:300]
    assert reason in answer


FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(data=hostile.RAW_REQUESTS)
def test_random_bytes_never_get_a_500(shared_sim_worker: SimWorker, data: bytes) -> None:
    """Any bytes get a well-formed answer or none, never a 500; the engine stays up."""
    port = _port(shared_sim_worker)
    hostile.assert_answered_sanely(hostile.exchange(port, data, half_close=True))
    hostile.assert_alive(port)


@FUZZ
@given(data=hostile.request_payloads(MODEL),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_random_json_never_gets_a_500(shared_sim_worker: SimWorker, data: bytes,
                                      path: str) -> None:
    """Any body (JSON with odd fields and values, NaN, deep nesting, bytes) gets an answer
    that is not a 500; the engine stays up."""
    port = _port(shared_sim_worker)
    answer = hostile.exchange(port, hostile.post(path, data))
    hostile.assert_answered_sanely(answer)
    assert hostile.status_of(answer) is not None
    hostile.assert_alive(port)
