"""`canary record` against a strict server that refuses `return_token_ids` (as Hugging Face
`transformers serve` does with a 422): the set falls back to golden text, and probes judge text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.health.probe import ProbeTarget, probe_worker
from dynamo_ftctl.health.record import record_canary_set
from dynamo_ftctl.http1 import Reply, Request
from dynamo_ftctl.inventory.canary import CanaryConfig

URL = "http://strict"
CONFIG = CanaryConfig(max_retries=0, timeout_s=1.0, parallel_prompts=False)
REFUSAL = (b'{"detail":"Unexpected fields in the request: {\'return_token_ids\'}"}')


@dataclass
class StrictServer:
    """Answers text only (no ids, no logprobs); a body naming `return_token_ids` gets a 422."""

    suffix: str = " Paris"
    bodies: list[dict[str, object]] = field(default_factory=list)

    def handle_request(self, request: Request) -> Reply:
        """The `http1.Transport` seam."""
        doc = request.json()
        self.bodies.append(doc)
        if "return_token_ids" in doc:
            return Reply(422, REFUSAL, {"content-type": "application/json"})
        answer = {"choices": [{"index": 0, "text": doc["prompt"][-3:] + self.suffix,
                               "finish_reason": "length"}]}
        return Reply(200, json.dumps(answer).encode(), {"content-type": "application/json"})


def test_record_on_a_server_refusing_token_ids_keeps_golden_text() -> None:
    """The refusal is learnt once; the set says return_token_ids false and holds text only."""
    server = StrictServer()
    recorded = record_canary_set(ProbeTarget("strict", URL), model="m", transport=server,
                                 prompts=(("a", "one"), ("b", "two")), repeats=2)
    assert recorded.return_token_ids is False
    assert [(p.expected_token_ids, p.expected_text) for p in recorded.prompts] == [
        (None, "one Paris"), (None, "two Paris")]
    assert all(p.expected_top_logprob_range is None for p in recorded.prompts)
    refused = [b for b in server.bodies if "return_token_ids" in b]
    assert len(refused) == 1  # the warm-up; every later request went without the field


def test_text_only_set_probes_healthy_then_flags_changed_text() -> None:
    """A probe with the recorded set sends no return_token_ids and compares the text."""
    server = StrictServer()
    recorded = record_canary_set(ProbeTarget("strict", URL), model="m", transport=server,
                                 prompts=(("a", "one"),), repeats=2, warmup_timeout_s=0)
    clock = FakeClock()
    healthy = probe_worker(ProbeTarget("strict", URL), recorded, CONFIG, transport=server,
                           clock=clock)
    assert healthy.verdict == "healthy", healthy.reason
    server.suffix = " Lyon"
    drifted = probe_worker(ProbeTarget("strict", URL), recorded, CONFIG, transport=server,
                           clock=clock)
    assert (drifted.verdict, drifted.kind) == ("unhealthy", "text_mismatch")
    assert drifted.mismatch is not None
    assert drifted.mismatch.position == 4
