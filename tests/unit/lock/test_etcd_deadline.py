"""EtcdLock's own deadline: a holder asking after its last confirmed renewal + TTL - margin
is refused, whether or not the watchdog thread has woken (a fenced write must not go out
after etcd may have given the key to another engine)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.http1 import MockTransport, NoConnection, Reply, Request
from dynamo_ftctl.lock import EtcdLock, LeaseLost

TTL = 30  # long: the watchdog thread sleeps on the real clock, the test moves a fake one


class Gateway:
    """etcd's v3 JSON gateway, as much as holding one key needs; keep-alives can be cut."""

    def __init__(self) -> None:
        self.cut = False

    def handle(self, request: Request) -> Reply:
        path = request.url.split("127.0.0.1:2379", 1)[1]
        if path == "/v3/lease/keepalive" and self.cut:
            msg = "partitioned"
            raise NoConnection(msg)
        doc: dict[str, Any] = {
            "/v3/lease/grant": {"ID": "7", "TTL": str(TTL)},
            "/v3/kv/txn": {"succeeded": True, "header": {"revision": "42"}},
            "/v3/lease/keepalive": {"result": {"ID": "7", "TTL": str(TTL)}},
            "/v3/lease/revoke": {},
        }.get(path, {})
        return Reply(200, json.dumps(doc).encode(), {"content-type": "application/json"})


@pytest.mark.parametrize("past_s", [TTL - 0.5, TTL, 10 * TTL])  # margin: 0.5 s
def test_the_holder_is_refused_once_its_deadline_passed(past_s: float) -> None:
    """Past `TTL - margin` after the grant with no renewal: ensure_held raises LeaseLost and
    is_held is False at once, and on_lost is told; before it, the lease holds."""
    clock = FakeClock()
    gateway = Gateway()
    told: list[LeaseLost] = []
    lock = EtcdLock(["http://127.0.0.1:2379"], "/t/k", 0, ttl_s=TTL, clock=clock,
                    transport=MockTransport(gateway.handle), on_lost=told.append)
    gateway.cut = True
    lease = lock.acquire(1)
    try:
        clock.advance(TTL / 2)
        assert lock.ensure_held() == lease
        assert lock.is_held
        clock.advance(past_s - TTL / 2)
        with pytest.raises(LeaseLost, match="no keep-alive confirmed"):
            lock.ensure_held()
        assert not lock.is_held
        assert len(told) == 1
    finally:
        lock.close()
