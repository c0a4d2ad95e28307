"""The sim's `nondeterministic` config: greedy answers vary, their length and finish do not."""

from __future__ import annotations

import pytest

from dynamo_ftctl.engine.config import EngineConfig, resolve_engine_config
from dynamo_ftctl.engine.scheduler import Engine, RequestParams

torch = pytest.importorskip("torch")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine() -> Engine:
    """One nondeterministic engine (seed 0) shared by the tests of this module."""
    torch.set_num_threads(1)
    return Engine(EngineConfig(nondeterministic=True), seed=0)


def answer(engine: Engine, params: RequestParams) -> tuple[tuple[int, ...], str | None]:
    """Generated ids and finish reason of one request run alone."""
    request = engine.new_request(engine.tokenizer.encode(PROMPT), params)
    engine.submit(request)
    ids: list[int] = []
    finish = None
    for _ in range(1000):
        if not engine.has_work():
            break
        for event in engine.step():
            assert event.error is None, event.error
            if event.token is not None:
                ids.append(event.token.token_id)
            finish = event.finish_reason or finish
    return tuple(ids), finish


def test_greedy_answers_differ_but_keep_their_shape(engine: Engine) -> None:
    """Eight greedy runs of one prompt: several answers, all 16 tokens ending on length."""
    runs = [answer(engine, RequestParams(max_tokens=16)) for _ in range(8)]
    assert len({ids for ids, _ in runs}) > 1
    assert {(len(ids), finish) for ids, finish in runs} == {(16, "length")}


def test_a_seed_does_not_make_it_repeat(engine: Engine) -> None:
    """A request seed does not pin a nondeterministic worker's greedy answer."""
    runs = {answer(engine, RequestParams(max_tokens=16, seed=7))[0] for _ in range(4)}
    assert len(runs) > 1


def test_sampled_requests_keep_their_seeded_answer(engine: Engine) -> None:
    """Temperature above 0 is untouched: the same seed gives the same ids."""
    params = RequestParams(max_tokens=16, temperature=0.8, seed=1234, ignore_eos=True)
    assert answer(engine, params) == answer(engine, params)


def test_the_option_is_off_by_default_and_set_by_override() -> None:
    """The preset is deterministic; the sim's --nondeterministic flag turns it on."""
    assert resolve_engine_config("ftctl-sim-tiny").nondeterministic is False
    assert resolve_engine_config("ftctl-sim-tiny", nondeterministic=True).nondeterministic
