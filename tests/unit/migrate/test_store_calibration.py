"""The KV connector store's calibration: its fit, its file, and the proxy's choice from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.migrate.calibrate import (
    Calibration,
    PrefillFit,
    Sample,
    TransferFit,
    fit_calibration,
    load_calibration,
    save_calibration,
)
from dynamo_ftctl.migrate.cost import PrefillModel, crossovers
from dynamo_ftctl.migrate.handoff import KvHandoff

LENGTHS = (256, 512, 768, 1024, 1536, 1792)


def blank(via: str = "store") -> Calibration:
    """A calibration of the tiny Llama's geometry whose fits are to be filled."""
    return Calibration(worker="a", peer="b", model="m", layers=2, kv_heads=4, head_dim=16,
                       dtype_bytes=4, block_size=128,
                       prefill=PrefillFit(fixed_s=0.0, per_token_s=1.0),
                       transfer=TransferFit(setup_s=0.0, bandwidth_bytes_per_s=1.0), via=via)


def curves(fixed: float, per_token: float, quad: float, setup: float,
           load_per_token: float) -> tuple[list[Sample], list[Sample]]:
    """Exact samples of recompute (fixed + n·per_token + n²·quad) and load (setup + n·l)."""
    recompute = [Sample(tokens=n, seconds=fixed + per_token * n + quad * n * n) for n in LENGTHS]
    load = [Sample(tokens=n, seconds=setup + load_per_token * n) for n in LENGTHS]
    return recompute, load


@settings(max_examples=60, deadline=None)
@given(fixed=st.floats(0.0, 0.01), per_token=st.floats(2e-6, 1e-4),
       quad=st.sampled_from([0.0, 1e-10, 1e-9]), share=st.floats(0.01, 0.5),
       crossing=st.floats(300, 1700))
def test_the_fit_finds_the_crossover_of_the_measured_curves(
        fixed: float, per_token: float, quad: float, share: float, crossing: float) -> None:
    """Exact samples of a load that costs `share` of recompute per token and crosses it at
    `crossing` tokens: the fit recovers both curves and records that crossover."""
    load_per_token = share * per_token
    # The load's setup that makes both cost the same at `crossing`.
    setup = fixed + (per_token - load_per_token) * crossing + quad * crossing * crossing
    recompute, load = curves(fixed, per_token, quad, setup, load_per_token)
    cal = fit_calibration(blank(), recompute, load)
    truth = crossovers(PrefillModel(per_token_s=per_token, per_token2_s=quad, fixed_s=fixed),
                       setup, load_per_token)
    assert truth[0] == pytest.approx(crossing, rel=1e-6)
    assert len(cal.crossover_tokens) == len(truth)
    for got, want in zip(cal.crossover_tokens, truth, strict=True):
        assert got == pytest.approx(want, rel=1e-3, abs=1)
    assert cal.prefill_samples == tuple(recompute)
    assert cal.transfer_samples == tuple(load)
    per_load_token = cal.kv_bytes_per_token / cal.transfer.bandwidth_bytes_per_s
    assert per_load_token == pytest.approx(load_per_token, rel=1e-4)


@settings(max_examples=60, deadline=None)
@given(per_token=st.floats(2e-6, 1e-4), share=st.floats(0.01, 0.5),
       crossing=st.floats(300, 1700), noise=st.lists(st.floats(-0.02, 0.02), min_size=12,
                                                     max_size=12))
def test_noisy_samples_choose_right_away_from_the_crossover(
        per_token: float, share: float, crossing: float, noise: list[float]) -> None:
    """Samples off by up to 2% each: the proxy still recomputes at half the crossover and
    loads at twice it (within the model's length)."""
    setup = (per_token - share * per_token) * crossing
    recompute, load = curves(0.0, per_token, 0.0, setup, share * per_token)
    jitter = iter(noise)
    recompute = [Sample(tokens=s.tokens, seconds=s.seconds * (1 + next(jitter)))
                 for s in recompute]
    load = [Sample(tokens=s.tokens, seconds=s.seconds * (1 + next(jitter))) for s in load]
    handoff = handoff_with(fit_calibration(blank(), recompute, load))
    assert bypassed(handoff, int(crossing / 2))
    assert not bypassed(handoff, min(int(crossing * 2), 4000))


def handoff_with(calibration: Calibration | None) -> KvHandoff:
    """A `KvHandoff` that holds `calibration` (no inventory read: the choice needs none)."""
    handoff = KvHandoff.__new__(KvHandoff)
    handoff.calibration = calibration
    return handoff


def bypassed(handoff: KvHandoff, tokens: int, **extra: Any) -> bool:
    """Whether a continuation of `tokens` context ids is sent with the store's load off."""
    body = {"model": "m", "prompt": list(range(tokens)), **extra}
    chosen = handoff.store_choice(body)
    if chosen is body:
        return False
    assert chosen["kv_transfer_params"]["ftctl_load"] is False
    assert {k: v for k, v in chosen.items() if k != "kv_transfer_params"} == \
        {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return True


def test_the_choice_follows_the_crossover_and_keeps_the_clients_params() -> None:
    """Below the crossover the load is turned off (the client's other kv_transfer_params
    kept), above it the body goes as it is; an export calibration, none, or a text
    prompt never touch it."""
    recompute, load = curves(0.0, 1e-5, 0.0, 1e-5 * 0.9 * 1000, 1e-6)  # crossing at 1000
    cal = fit_calibration(blank(), recompute, load)
    assert cal.crossover_tokens == (1000,)
    handoff = handoff_with(cal)
    assert bypassed(handoff, 999)
    assert not bypassed(handoff, 1001)
    body = {"prompt": [1] * 10, "kv_transfer_params": {"x": 1, "ftctl_load": True}}
    assert handoff.store_choice(body)["kv_transfer_params"] == {"x": 1, "ftctl_load": False}
    assert body["kv_transfer_params"] == {"x": 1, "ftctl_load": True}  # not changed in place
    text = {"prompt": "hello"}
    assert handoff.store_choice(text) is text
    for other in (None, fit_calibration(blank("export"), recompute, load)):
        assert not bypassed(handoff_with(other), 10)


def test_a_store_calibration_file_round_trips_and_a_bad_via_is_named(tmp_path: Path) -> None:
    """via and crossover_tokens are saved and read back; an unknown via names its key."""
    recompute, load = curves(0.001, 1e-5, 1e-10, 0.005, 1e-6)
    cal = fit_calibration(blank(), recompute, load)
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    doc = json.loads(path.read_text())
    assert doc["via"] == "store"
    assert doc["crossover_tokens"] == list(cal.crossover_tokens)
    doc["via"] = "carrier-pigeon"
    path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(InventoryError) as info:
        load_calibration(path)
    assert info.value.key == "via"


def test_cli_calibrate_with_an_unknown_via_exits_2_before_measuring(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`migrate calibrate --via pigeon` is bad input, one line naming --via (no worker is
    reached: the inventory's worker listens nowhere)."""
    from dynamo_ftctl.cli.main import main

    inventory = tmp_path / "inv.yaml"
    inventory.write_text("cluster: c\nworkers:\n  - name: w\n    url: http://127.0.0.1:9\n"
                         "    model: m\n")
    code = main(["-i", str(inventory), "migrate", "calibrate", "--worker", "w", "--via",
                 "pigeon", "-o", str(tmp_path / "cal.json")])
    assert code == 2
    assert "--via must be export or store (got 'pigeon')" in capsys.readouterr().err
