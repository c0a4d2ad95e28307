"""Fake transports for canary tests: scripted answers, time taken from a FakeClock."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.health.canaryset import CanarySet
from dynamo_ftctl.health.transport import TransportError
from dynamo_ftctl.http1 import MockTransport, Reply, Request
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


def answer(ids: list[int], top: float = -0.7) -> Reply:
    body = {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids,
                         "finish_reason": "length",
                         "logprobs": {"tokens": ["x"] * len(ids),
                                      "token_logprobs": [top] * len(ids),
                                      "top_logprobs": [{"x": top}] * len(ids)}}]}
    return Reply(200, json.dumps(body).encode(), {"content-type": "application/json"})


Behaviour = Callable[[str], "Reply | TransportError"]


def good(prompt: str) -> Reply:
    return answer(GOLDEN[prompt])


def corrupt(prompt: str) -> Reply:
    ids = list(GOLDEN[prompt])
    ids[1] += 100
    return answer(ids)


def refused(_: str) -> TransportError:
    return TransportError("refused", "connection refused by fake")


def reset(_: str) -> TransportError:
    return TransportError("reset", "connection lost: ConnectionResetError")


@dataclass
class FakeWorkers(MockTransport):
    """A `MockTransport` answering by worker URL; each call takes `latency_s[url]` of fake
    time."""

    clock: FakeClock
    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self._answer)

    def _answer(self, request: Request) -> Reply:
        url, body = request.url, request.body
        base = url.split("/v1/", maxsplit=1)[0]
        self.calls.append(base)
        self.clock.advance(self.latency_s.get(base, 0.01))
        prompt = json.loads(body)["prompt"]
        result = self.behaviour.get(base, good)(prompt)
        if isinstance(result, TransportError):
            raise result
        return result


@dataclass
class AsyncFakeWorkers(FakeWorkers):
    """The same, named for the daemon (a `MockTransport` serves awaited calls too)."""
