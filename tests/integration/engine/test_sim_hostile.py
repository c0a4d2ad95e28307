"""`ftctl sim serve` against hostile bodies and bytes: strict JSON (depth, NaN), heads too
large, a slowloris client, and fuzzing that must never get a 500 or take the engine down."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests import hostile
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory

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


@pytest.mark.parametrize("head", [
    b"X-Big: " + b"a" * 100_000 + b"\r\n",
    b"".join(b"X-H%d: v\r\n" % i for i in range(100_000)),
], ids=["100KB-header", "100000-headers"])
def test_a_head_too_large_is_a_431(shared_sim_worker: SimWorker, head: bytes) -> None:
    """A 100 KB header or 100,000 headers get 431 and a hang-up (uvicorn answered 200)."""
    port = _port(shared_sim_worker)
    answer = hostile.exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
    assert hostile.status_of(answer) == 431, answer[:300]
    hostile.assert_alive(port)


def test_a_slowloris_client_is_answered_408_in_time(
        sim_worker_factory: SimWorkerFactory) -> None:
    """A head trickled a line at a time, never ended, gets 408 and a hang-up once the
    request timeout has passed (uvicorn held such clients for good)."""
    timeout_s = 1.0
    worker = sim_worker_factory(name="slow", args=["--request-timeout-s", str(timeout_s)])
    with socket.create_connection(("127.0.0.1", _port(worker)), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(0.2)
        answer = b""

        def hung_up() -> bool:
            nonlocal answer
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                sock.sendall(b"X-Slow: 1\r\n")  # a byte now and then, as slowloris does
                return False
            except ConnectionResetError:
                return True
            answer += piece
            return not piece

        wait_until(hung_up, timeout_s + 10, "the worker to hang up on the slow head", interval=0)
        took = time.monotonic() - start
    assert hostile.status_of(answer) == 408, answer[:300]
    assert timeout_s * 0.9 <= took < timeout_s + 10


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
