"""The sim refuses every value it cannot run with a 400, and one request that still fails an
engine step never ends the others of its batch (issue 29, case 3)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_ftctl.engine.config import EngineConfig
from dynamo_ftctl.engine.errors import BatchDeath, ParamError
from dynamo_ftctl.engine.scheduler import Engine, EngineRequest, RequestParams
from dynamo_ftctl.engine.validation import parse_generation
from dynamo_ftctl.errors import InvalidInput

torch = pytest.importorskip("torch")

FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
          "min_tokens", "logprobs", "n", "ignore_eos", "prompt")
HOSTILE = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4)
           | st.lists(st.integers(-(2**70), 2**70) | st.text(max_size=2), max_size=4))


@pytest.fixture(scope="module")
def engine() -> Engine:
    """One small engine for the module."""
    torch.set_num_threads(1)
    return Engine(EngineConfig(), seed=0)


def step_until_done(engine: Engine, requests: list[EngineRequest]) -> dict[str, Any]:
    """Ids per request, or the error that ended it."""
    out: dict[str, Any] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.submit(request)
    for _ in range(2_000):
        if not engine.has_work():
            break
        for event in engine.step():
            if event.error is not None:
                out[event.request_id] = event.error
            elif event.token is not None:
                out[event.request_id].append(event.token.token_id)
    assert not engine.has_work()
    return out


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.fixed_dictionaries({}, optional=dict.fromkeys(FIELDS, HOSTILE)))
def test_any_value_is_refused_or_runs(engine: Engine, values: dict[str, Any]) -> None:
    """Whatever a client puts in the sampling fields: a 400 naming a field, or a request the
    engine steps to its end beside a healthy one whose tokens stay those of a run alone."""
    body = {"model": "ftctl-sim-tiny", "prompt": "hello", **values}
    if body.get("prompt") is None:
        body["prompt"] = "hello"
    try:
        generation = parse_generation(body, engine.config, engine.tokenizer, chat=False)
    except ParamError as exc:
        refused = exc
    else:
        refused = None
    if refused is not None:
        assert refused.param is None or refused.param in body
        return
    params = generation.params
    capped = RequestParams(**{**params.to_json(), "max_tokens": min(params.max_tokens, 3),
                              "min_tokens": 0,
                              "stop_token_ids": tuple(params.stop_token_ids)})
    try:
        hostile = engine.new_request(generation.prompt_ids, capped)
    except InvalidInput:  # the routes answer it 400 too (an empty or too long prompt)
        return
    healthy_params = RequestParams(max_tokens=4, ignore_eos=True)
    alone = step_until_done(engine, [engine.new_request([65, 66, 67], healthy_params)])
    healthy = engine.new_request([65, 66, 67], healthy_params)
    both = step_until_done(engine, [hostile, healthy])
    assert isinstance(both[hostile.request_id], list), both[hostile.request_id]
    assert both[healthy.request_id] == next(iter(alone.values()))


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2**63), ("top_k", 1_000_000), ("top_k", -5), ("stop_token_ids", ["x"]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**40]), ("seed", 2**70),
    ("temperature", 1e300), ("max_tokens", 2**63), ("min_tokens", 10_000),
    ("prompt", [65, -5]), ("prompt", [65, 2**70]), ("logprobs", 21),
])
def test_the_issue_values_are_a_400_naming_the_field(engine: Engine, field: str,
                                                     value: Any) -> None:
    """The values that broke the sim's engine step (or got a 500) are refused up front."""
    body = {"model": "ftctl-sim-tiny", "prompt": "hello", "max_tokens": 4, "temperature": 1,
            field: value}
    with pytest.raises(ParamError) as caught:
        parse_generation(body, engine.config, engine.tokenizer, chat=False)
    assert caught.value.param == field


def test_a_tiny_temperature_is_greedy(engine: Engine) -> None:
    """Below 1e-5 (vLLM's epsilon) sampling would divide into infinities: it is greedy."""
    body = {"model": "ftctl-sim-tiny", "prompt": "hello", "temperature": 1e-300}
    params = parse_generation(body, engine.config, engine.tokenizer, chat=False).params
    assert params.temperature == 0.0


def test_a_request_that_fails_the_step_ends_alone(engine: Engine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a request still break the batched step, it ends with an error event and the
    requests batched with it go on with the tokens they get alone."""
    params = RequestParams(max_tokens=6, ignore_eos=True)
    alone = step_until_done(engine, [engine.new_request([70, 71], params)])
    bad = engine.new_request([65, 66], RequestParams(max_tokens=6, ignore_eos=True, seed=4242))
    good = engine.new_request([70, 71], params)
    compute = Engine._compute

    def fragile(self: Engine, scheduled: list[EngineRequest]) -> Any:
        if any(r.seed == 4242 for r in scheduled):
            msg = "index out of range in self"
            raise IndexError(msg)
        return compute(self, scheduled)

    monkeypatch.setattr(Engine, "_compute", fragile)
    out = step_until_done(engine, [bad, good])
    assert "index out of range" in out[bad.request_id]
    assert out[good.request_id] == next(iter(alone.values()))


def test_the_poison_fault_ends_the_whole_batch(engine: Engine) -> None:
    """The poison fault is a batch death on purpose (vLLM's EngineDeadError): its step is
    not split per request."""
    engine.poison_seed = 666
    try:
        engine.submit(engine.new_request([65], RequestParams(max_tokens=4, seed=666)))
        engine.submit(engine.new_request([66], RequestParams(max_tokens=4)))
        with pytest.raises(BatchDeath):
            engine.step()  # both join the batch, and it dies
    finally:
        engine.poison_seed = None
        for request in list(engine.running) + list(engine.waiting):
            engine.abort(request.request_id)
        while engine.has_work():
            engine.step()
