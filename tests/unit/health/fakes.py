"""Fake transports for canary tests: scripted answers, time taken from a FakeClock."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.health.canaryset import CanarySet
from dynamo_ftctl.health.transport import HttpReply, TransportError
from dynamo_ftctl.structs import convert_struct

SET = convert_struct({
    "model": "m",
    "prompts": [
        {"name": "a", "prompt": "one", "max_tokens": 3, "expected_token_ids": [1, 2, 3],
         "expected_top_logprob_range": [-1.0, -0.5]},
        {"name": "b", "prompt": "two", "max_tokens": 3, "expected_token_ids": [4, 5, 6]},
    ],
}, CanarySet)
GOLDEN = {"one": [1, 2, 3], "two": [4, 5, 6]}


def answer(ids: list[int], top: float = -0.7) -> HttpReply:
    body = {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids,
                         "finish_reason": "length",
                         "logprobs": {"tokens": ["x"] * len(ids),
                                      "token_logprobs": [top] * len(ids),
                                      "top_logprobs": [{"x": top}] * len(ids)}}]}
    return HttpReply(200, json.dumps(body).encode(), "application/json")


Behaviour = Callable[[str], "HttpReply | TransportError"]


def good(prompt: str) -> HttpReply:
    return answer(GOLDEN[prompt])


def corrupt(prompt: str) -> HttpReply:
    ids = list(GOLDEN[prompt])
    ids[1] += 100
    return answer(ids)


def refused(_: str) -> TransportError:
    return TransportError("refused", "connection refused by fake")


def reset(_: str) -> TransportError:
    return TransportError("reset", "connection lost: ConnectionResetError")


@dataclass
class FakeWorkers:
    """Answers by worker URL; each call takes `latency_s[url]` of fake time."""

    clock: FakeClock
    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def _answer(self, url: str, body: bytes) -> HttpReply:
        base = url.split("/v1/", maxsplit=1)[0]
        self.calls.append(base)
        self.clock.advance(self.latency_s.get(base, 0.01))
        prompt = json.loads(body)["prompt"]
        result = self.behaviour.get(base, good)(prompt)
        if isinstance(result, TransportError):
            raise result
        return result

    def post_json(self, url: str, body: bytes, *, timeout_s: float,
                  headers: Mapping[str, str] | None = None) -> HttpReply:
        del timeout_s, headers
        return self._answer(url, body)


@dataclass
class AsyncFakeWorkers(FakeWorkers):
    """The same, as an async transport for the daemon."""

    async def post_json(  # type: ignore[override]
        self, url: str, body: bytes, *, timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> HttpReply:
        del timeout_s, headers
        return self._answer(url, body)
