"""The engine core in-process: determinism, continuation at any cut point, paging, KV moves."""

from __future__ import annotations

import random

import pytest

from dynamo_ftctl.engine.config import EngineConfig
from dynamo_ftctl.engine.sampling import uniform
from dynamo_ftctl.engine.scheduler import Engine, EngineRequest, RequestParams
from dynamo_ftctl.errors import InvalidInput

torch = pytest.importorskip("torch")

GEN = 64


@pytest.fixture(scope="module")
def engine() -> Engine:
    """One default engine (seed 0) shared by the tests of this module."""
    torch.set_num_threads(1)
    return Engine(EngineConfig(), seed=0)


def run_all(engine: Engine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], list[float]]]:
    """Submit every request, step until all finish; ids and logprobs per request."""
    out: dict[str, tuple[list[int], list[float]]] = {r.request_id: ([], []) for r in requests}
    for request in requests:
        engine.submit(request)
    for _ in range(10_000):
        if not engine.has_work():
            break
        for event in engine.step():
            assert event.error is None, event.error
            if event.token is not None:
                out[event.request_id][0].append(event.token.token_id)
                out[event.request_id][1].append(event.token.logprob)
    assert not engine.has_work()
    return out


def generate(engine: Engine, prompt: list[int], params: RequestParams) -> list[int]:
    """Generated ids of one request run alone."""
    request = engine.new_request(prompt, params)
    return run_all(engine, [request])[request.request_id][0]


PARAMS = {
    "greedy": RequestParams(max_tokens=GEN, ignore_eos=True),
    "sampled": RequestParams(max_tokens=GEN, temperature=0.8, top_p=0.9, top_k=40, seed=1234,
                             ignore_eos=True),
}


def test_same_request_twice_is_identical(engine: Engine) -> None:
    """Token ids and logprobs repeat exactly, greedy and seeded."""
    prompt = engine.tokenizer.encode("The same prompt, twice.")
    for params in PARAMS.values():
        first = run_all(engine, [engine.new_request(prompt, params, "a")])["a"]
        second = run_all(engine, [engine.new_request(prompt, params, "b")])["b"]
        assert first == second


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("chat", [False, True])
def test_fifty_cut_points_continue_exactly(engine: Engine, mode: str, chat: bool) -> None:
    """prompt + first k ids with the remaining max_tokens yields exactly the remaining ids."""
    tok = engine.tokenizer
    if chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    else:
        prompt = tok.encode("Once upon a time")
    params = PARAMS[mode]
    full = generate(engine, prompt, params)
    assert len(full) == GEN
    cuts = [1, GEN - 1, *random.Random(f"{mode}{chat}").sample(range(2, GEN - 1), 48)]
    assert len(set(cuts)) == 50
    requests = []
    retokenized_differ = 0
    for k in cuts:
        ids = prompt + full[:k]
        if chat:
            # The generated text re-sent as an assistant message to continue is NOT the
            # same prompt under BPE: only the ids continue exactly (the proxy's hazard).
            text = tok.decode(full[:k])
            via_text = tok.apply_chat_template(
                [{"role": "user", "content": "Tell me a story."},
                 {"role": "assistant", "content": text}],
                add_generation_prompt=False, continue_final_message=True)
            retokenized_differ += via_text != ids
        rest = RequestParams(**{**params.__dict__, "max_tokens": GEN - k})
        requests.append(engine.new_request(ids, rest, f"cut-{k}"))
    assert retokenized_differ > 0 or not chat
    # All 50 continuations run batched together: batching must not change any token.
    results = run_all(engine, requests)
    for k in cuts:
        assert results[f"cut-{k}"][0] == full[k:], f"cut point {k}"


def test_batch_does_not_change_outputs(engine: Engine) -> None:
    """A request decoded alongside others of different lengths gives its solo tokens."""
    tok = engine.tokenizer
    prompts = [tok.encode("x" * n) for n in (3, 40, 130)]
    solo = [generate(engine, p, PARAMS["sampled"]) for p in prompts]
    batch = run_all(engine, [engine.new_request(p, PARAMS["sampled"], str(i))
                             for i, p in enumerate(prompts)])
    assert [batch[str(i)][0] for i in range(3)] == solo


def test_block_exhaustion_queues_and_preempts() -> None:
    """With a pool for ~2 requests, 6 requests all finish correctly; none fails."""
    small = Engine(EngineConfig(num_blocks=12, max_num_seqs=8), seed=0)
    prompt = small.tokenizer.encode("p" * 40)
    params = RequestParams(max_tokens=40, ignore_eos=True)
    expected = generate(small, prompt, params)
    requests = [small.new_request(prompt, params, f"r{i}") for i in range(6)]
    for request in requests:
        small.submit(request)
    saw_waiting = False
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(5000):
        if not small.has_work():
            break
        for event in small.step():
            assert event.error is None
            if event.token is not None:
                out[event.request_id].append(event.token.token_id)
        saw_waiting |= small.num_waiting > 0
        assert small.allocator.used <= 12
    assert saw_waiting
    assert all(ids == expected for ids in out.values())
    assert small.allocator.used == 0  # every block came back


def test_kv_export_import_continues_identically(engine: Engine) -> None:
    """Export mid-generation, import into a second engine: the rest is identical."""
    other = Engine(EngineConfig(), seed=0)
    prompt = engine.tokenizer.encode("Move me to another engine, please.")
    params = PARAMS["sampled"]
    full = generate(engine, prompt, params)
    request = engine.new_request(prompt, params, "moving")
    engine.submit(request)
    got: list[int] = []
    while len(got) < 20:
        got += [e.token.token_id for e in engine.step() if e.token is not None]
    blob = engine.export_kv("moving")
    engine.abort("moving")
    engine.step()
    resumed = other.import_kv(blob)
    rest = run_all(other, [resumed])["moving"][0]
    assert got + rest == full
    corrupted = bytearray(blob)
    corrupted[-100] ^= 0x40
    with pytest.raises(InvalidInput, match=r"block \d+ of \d+ is corrupted"):
        other.import_kv(bytes(corrupted))


def test_too_long_and_sleep_wake(engine: Engine) -> None:
    """Over-long requests are refused; sleep drops requests and wake restores the same model."""
    with pytest.raises(InvalidInput, match="maximum context length is 2048"):
        engine.new_request([1] * 2000, RequestParams(max_tokens=100))
    prompt = engine.tokenizer.encode("sleepy")
    before = generate(engine, prompt, PARAMS["greedy"])
    engine.submit(engine.new_request(prompt, PARAMS["greedy"], "dropped"))
    engine.step()
    assert engine.sleep(level=2) == ["dropped"]
    engine.wake()
    assert generate(engine, prompt, PARAMS["greedy"]) == before


def test_uniform_is_a_pure_function() -> None:
    """The sampling draw depends only on (seed, position) and lies in [0, 1)."""
    draws = [uniform(7, p) for p in range(1000)]
    assert draws == [uniform(7, p) for p in range(1000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert 0.45 < sum(draws) / len(draws) < 0.55


def test_retained_blocks_are_not_load_but_stay_exportable() -> None:
    """A cut request's retained blocks leave kv_usage at 0, still export, and lapse in time."""
    small = Engine(EngineConfig(num_blocks=24, max_num_seqs=8), seed=0)
    request = small.new_request(small.tokenizer.encode("p" * 40), PARAMS["greedy"], "cut")
    small.submit(request)
    for _ in range(20):
        small.step()
    live_usage = small.kv_usage
    assert live_usage == small.allocator.usage > 0
    small.abort("cut", retain=True)
    small.step()
    assert "cut" in small.retained
    assert small.allocator.used > 0
    assert small.kv_usage == 0.0
    assert len(small.export_kv("cut")) > 0  # what the retention is for
    due = small.next_expiry()
    assert due is not None
    assert small.expire_retained(now=due - 1) == 0
    assert small.expire_retained(now=due + 1) == 1
    assert small.allocator.used == 0
    assert small.next_expiry() is None


def test_retained_kv_lapses_on_a_timer_with_nothing_to_step() -> None:
    """An idle engine frees a cut stream's retained blocks once retain_s has passed."""
    import asyncio

    from dynamo_ftctl.engine.driver import AsyncEngine
    from dynamo_ftctl.engine.faults import FaultState
    from dynamo_ftctl.engine.metrics import EngineMetrics
    from tests.waiting import until

    small = Engine(EngineConfig(num_blocks=24, max_num_seqs=8), seed=0)
    small.retain_s = 0.3

    async def go() -> None:
        driver = AsyncEngine(small, FaultState(), EngineMetrics("m"))
        await driver.start()
        try:
            request = small.new_request(small.tokenizer.encode("p" * 40), PARAMS["greedy"])
            tokens = 0
            stream = driver.generate(request)
            async for event in stream:
                tokens += event.token is not None
                if tokens == 5:
                    break
            await stream.aclose()  # the client went away: its blocks are retained
            await until(lambda: request.request_id in small.retained)
            assert small.allocator.used > 0
            assert not small.has_work()
            await until(lambda: not small.retained, 5.0)
            assert small.allocator.used == 0
        finally:
            await driver.stop()

    asyncio.run(asyncio.wait_for(go(), 30))
