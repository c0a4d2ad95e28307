"""Measure a worker's real rates and fit the cost model: the calibration file.

`calibrate` times, on live workers:

- **prefill**: time to the first token of a `max_tokens=1` completion at
  several prompt lengths; fitted to `fixed + n·per_token + n²·per_token2`
  (least squares over the non-negative models);
- **KV transfer**: for an in-flight request of each length, the export from
  the worker plus the import on the peer up to the first new token; fitted
  to `setup + n·seconds_per_token`, i.e. a bandwidth of
  `kv_bytes_per_token / seconds_per_token`.

Both timings end at the first new token, so they include the same decode
step and compare like with like.

`calibrate_store` does the same for workers that share ftctl's KV connector's store
(vLLM, `dynamo_ftctl.vllm_connector`), where a continuation's KV comes from the
store, not from an export: for each context length, a fresh prompt is computed on
the worker (its blocks are saved), then timed on the peer twice over, loaded (its
prefix blocks read from the store) and recomputed (another such prompt, sent with
`kv_transfer_params.ftctl_load` false). Each timed request is one non-streamed
`max_tokens=1` completion, and the connector's report in its answer (tokens loaded)
proves which way it went. The load is fitted as the "transfer", the recompute as the
prefill; `via` is "store", and the proxy then chooses between letting the store load
and turning it off, per continuation. The result is a JSON file (written
atomically) that `ftctl migrate plan --calibration`, `ftctl migrate request
--method auto` and the proxy read back through `load_calibration`, with the
usual `file:line: key: message` errors.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import FtctlError, InvalidInput
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.kv.layout import KVGeometry
from dynamo_ftctl.migrate.cost import (
    GPUS,
    Link,
    MigrationPlan,
    ModelPreset,
    PlanTable,
    PrefillModel,
    crossovers,
    link_preset,
    model_preset,
    plan_migration,
    plan_table,
)
from dynamo_ftctl.structs import StrictStruct, doc, load_struct, to_data

if TYPE_CHECKING:
    from rich.console import Group

    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.inventory import Inventory
    from dynamo_ftctl.migrate.transfer import Endpoint

__all__ = [
    "Calibration",
    "CalibrationResult",
    "PlanOverrides",
    "calibrate",
    "calibrate_store",
    "calibrate_workers",
    "fit_calibration",
    "fit_prefill",
    "fit_transfer",
    "load_calibration",
    "parse_lengths",
    "plan_from_options",
    "save_calibration",
]

# Per connection, header wait and read (the CLI's --timeout default).
_TIMEOUT_S = 60.0
_JSON = {"Content-Type": "application/json"}


class PrefillFit(StrictStruct, frozen=True, kw_only=True):
    """Prefill seconds = fixed_s + n·per_token_s + n²·per_token2_s."""

    fixed_s: Annotated[float, doc("Seconds independent of the prompt length.", ge=0)]
    per_token_s: Annotated[float, doc("Seconds per prompt token (linear term).", ge=0)]
    per_token2_s: Annotated[float, doc("Seconds per squared token (attention).", ge=0)] = 0.0


class TransferFit(StrictStruct, frozen=True, kw_only=True):
    """KV move seconds = setup_s + n·kv_bytes_per_token / bandwidth_bytes_per_s."""

    setup_s: Annotated[float, doc("Fixed cost of one export + import.", ge=0)]
    bandwidth_bytes_per_s: Annotated[float, doc("Effective export/import bandwidth.", gt=0)]


class Sample(StrictStruct, frozen=True, kw_only=True):
    """One measured point: context tokens and median seconds."""

    tokens: Annotated[int, Meta(ge=0)]
    seconds: Annotated[float, Meta(ge=0)]


class Calibration(StrictStruct, frozen=True, kw_only=True):
    """Measured rates of one worker (and its peer for KV moves)."""

    version: Annotated[int, doc("File format version.", ge=1, le=1)] = 1
    worker: Annotated[str, doc("Worker whose prefill was timed.", min_length=1)]
    peer: Annotated[str, doc("Worker that imported the KV exports.", min_length=1)]
    model: Annotated[str, doc("Served model id.", min_length=1)]
    layers: Annotated[int, doc("KV geometry from the export header.", ge=1)]
    kv_heads: Annotated[int, Meta(ge=1)]
    head_dim: Annotated[int, Meta(ge=1)]
    dtype_bytes: Annotated[int, Meta(ge=1)]
    block_size: Annotated[int, Meta(ge=1)]
    prefill: PrefillFit
    transfer: TransferFit
    prefill_samples: tuple[Sample, ...] = ()
    transfer_samples: tuple[Sample, ...] = ()
    measured_at: Annotated[float, doc("Unix time of the measurement.", ge=0)] = 0.0
    via: Annotated[Literal["export", "store"], doc(
        "How KV reaches the next worker: export (/admin/kv export and import) or store "
        "(ftctl's vLLM KV connector; transfer is then the store's load).")] = "export"
    crossover_tokens: Annotated[tuple[int, ...], doc(
        "Context lengths where the fitted load and recompute cost the same, ascending "
        "(recorded for reading; the decision uses the fits).")] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return self.geometry().bytes_per_token()

    def geometry(self) -> KVGeometry:
        """The worker's KV geometry."""
        return KVGeometry(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)

    def model_preset(self) -> ModelPreset:
        """A model preset with this geometry (its FLOP fields unused: prefill is measured)."""
        return ModelPreset(self.model, self.geometry(), q_heads=1, attn_dim=1, active_params=1.0,
                           source=f"calibrated on {self.worker}")

    def link(self) -> Link:
        """The measured export/import path as a link."""
        return Link(f"{self.worker}→{self.peer}", self.transfer.bandwidth_bytes_per_s,
                    self.transfer.setup_s, per_gpu=True, description="measured")

    def prefill_model(self) -> PrefillModel:
        """The measured prefill model."""
        p = self.prefill
        return PrefillModel(per_token_s=p.per_token_s, per_token2_s=p.per_token2_s,
                            fixed_s=p.fixed_s)

    def crossovers(self) -> tuple[float, ...]:
        """Context lengths where the measured KV move and re-prefill cost the same."""
        per_token = self.kv_bytes_per_token / self.transfer.bandwidth_bytes_per_s
        return crossovers(self.prefill_model(), self.transfer.setup_s, per_token)


def load_calibration(path: Path) -> Calibration:
    """Read a calibration file; errors name the file, line and key (exit 2)."""
    return load_struct(path, Calibration, what="a calibration mapping")


def save_calibration(calibration: Calibration, path: Path) -> None:
    """Write a calibration file atomically (JSON)."""
    from dynamo_ftctl.output import write_atomic

    write_atomic(path, json.dumps(to_data(calibration), indent=2) + "\n")


# ------------------------------------------------------------------- fitting


def _solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares by the normal equations (at most 3 unknowns), None when singular."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]


def _fit_nonneg(xs: Sequence[float], ys: Sequence[float], powers: Sequence[int]) -> list[float]:
    """Coefficients of Σ c_p·x^p with every c_p >= 0 and the least relative squared error.

    Relative error (each point weighted by 1/y) keeps the short prompts, whose
    times are small, from being ignored next to the long ones: the crossover
    usually sits among the short ones.
    """
    weights = [1.0 / y if y > 0 else 1.0 for y in ys]
    best: tuple[float, list[float]] | None = None
    for size in range(1, len(powers) + 1):
        for subset in itertools.combinations(powers, size):
            if len(xs) < len(subset):
                continue
            # Scale x so that the normal equations stay well conditioned.
            scale = max(*(abs(x) for x in xs), 1.0)
            rows = [[w * (x / scale) ** p for p in subset]
                    for x, w in zip(xs, weights, strict=True)]
            coef = _solve(rows, [w * y for y, w in zip(ys, weights, strict=True)])
            if coef is None or any(c < 0 for c in coef):
                continue
            full = dict.fromkeys(powers, 0.0)
            for p, c in zip(subset, coef, strict=True):
                full[p] = c / scale**p
            sse = sum((w * (y - sum(full[p] * x**p for p in powers))) ** 2
                      for x, y, w in zip(xs, ys, weights, strict=True))
            if best is None or sse < best[0]:
                best = (sse, [full[p] for p in powers])
    if best is None:
        msg = "cannot fit the measurements (need at least one point per term)"
        raise InvalidInput(msg)
    return best[1]


def fit_prefill(samples: Sequence[Sample]) -> PrefillFit:
    """Fit fixed + n·per_token + n²·per_token2 (all >= 0) to (tokens, seconds) samples."""
    f, lin, quad = _fit_nonneg([s.tokens for s in samples], [s.seconds for s in samples],
                               (0, 1, 2))
    if lin == 0 and quad == 0:
        msg = "prefill time does not grow with the prompt length: cannot fit a rate"
        raise InvalidInput(msg)
    return PrefillFit(fixed_s=f, per_token_s=lin, per_token2_s=quad)


def fit_transfer(samples: Sequence[Sample], kv_bytes_per_token: int) -> TransferFit:
    """Fit setup + n·seconds_per_token (both >= 0) to KV-move samples."""
    setup, per_token = _fit_nonneg([s.tokens for s in samples], [s.seconds for s in samples],
                                   (0, 1))
    # A move that does not slow down with size is bandwidth-unbound: cap at 1 PB/s.
    bandwidth = kv_bytes_per_token / per_token if per_token > 0 else 1e15
    return TransferFit(setup_s=setup, bandwidth_bytes_per_s=bandwidth)


# --------------------------------------------------------------- measuring


def parse_lengths(text: str) -> tuple[int, ...]:
    """Comma-separated positive prompt lengths (at least three, for the quadratic fit)."""
    try:
        values = tuple(sorted({int(v) for v in text.replace(" ", "").split(",") if v}))
    except ValueError:
        msg = f"--lengths: expected comma-separated integers, got {text!r}"
        raise InvalidInput(msg) from None
    if len(values) < 3 or values[0] < 1:
        msg = "--lengths: give at least three distinct lengths >= 1"
        raise InvalidInput(msg)
    return values


def prompt_ids(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of printable-ASCII byte tokens (valid for byte tokenizers)."""
    return [32 + (i * 7 + salt) % 95 for i in range(length)]


async def _served_model(client: Client, ep: Endpoint, timeout_s: float) -> tuple[str, int]:
    from dynamo_ftctl.migrate.transfer import fetch, http_errors, refusal

    async with http_errors("GET /v1/models", ep):
        status, body = await fetch(client, "GET", f"{ep.url}/v1/models", timeout_s=timeout_s)
    if status != 200:
        raise refusal(ep, "GET /v1/models", status, body)
    first = loads(body)["data"][0]
    return str(first["id"]), int(first.get("max_model_len") or 2048)


async def time_prefill(
    client: Client, ep: Endpoint, model: str, length: int, *, clock: Clock,
    salt: int = 0, timeout_s: float = _TIMEOUT_S,
) -> float:
    """Seconds to the first token of a `max_tokens=1` completion of `length` prompt tokens."""
    from dynamo_ftctl.migrate.transfer import stream_completion
    from dynamo_ftctl.openai import completion_request

    body = completion_request(model, prompt_ids(length, salt), max_tokens=1, temperature=0.0,
                              stream=True, return_token_ids=True)
    cont = await stream_completion(client, ep, "prefill", "POST", f"{ep.url}/v1/completions",
                                   clock=clock, body=json.dumps(body).encode(),
                                   headers=_JSON, timeout_s=timeout_s)
    return cont.first_token_s


async def start_in_flight(
    client: Client, ep: Endpoint, model: str, length: int, *, max_tokens: int,
    request_id: str, seed: int = 0, temperature: float = 0.0,
    timeout_s: float = _TIMEOUT_S,
) -> asyncio.Task[None]:
    """Start a streaming request and return once its first token has arrived.

    The returned task keeps reading the stream until the request ends (it is
    exported and aborted next); cancel it when done.
    """
    from dynamo_ftctl.migrate.transfer import http_errors, refusal
    from dynamo_ftctl.openai import SseDecoder, completion_request, parse_sse_event

    body = completion_request(model, prompt_ids(length), max_tokens=max_tokens,
                              temperature=temperature, seed=seed, stream=True,
                              return_token_ids=True, extra={"ignore_eos": True})
    first = asyncio.get_running_loop().create_future()

    async def read() -> None:
        try:
            async with http_errors("start request", ep):
                response = await client.request(
                    "POST", f"{ep.url}/v1/completions", json.dumps(body).encode(),
                    {**_JSON, "X-Request-Id": request_id},
                    connect_timeout_s=timeout_s, head_timeout_s=timeout_s)
                async with response:
                    if response.status != 200:
                        answer = await response.read(timeout_s=timeout_s)
                        raise refusal(ep, "start request", response.status or 0, answer)
                    decoder = SseDecoder()
                    while chunk := await response.next_chunk(timeout_s):
                        for event in decoder.feed(chunk):
                            try:
                                parsed = parse_sse_event(event)
                            except FtctlError:  # the abort ends the stream with an error event
                                parsed = None
                            if parsed is not None and parsed.token_ids and not first.done():
                                first.set_result(None)
        except Exception as exc:  # handed to the waiter below
            if not first.done():
                first.set_exception(exc)
            return
        if not first.done():
            first.set_exception(InvalidInput(f"{ep.name}: request ended before its first token"))

    task = asyncio.create_task(read())
    try:
        await first
    except BaseException:
        task.cancel()
        raise
    return task


async def time_kv_move(
    client: Client, worker: Endpoint, peer: Endpoint, *, model: str, length: int,
    max_model_len: int, repeats: int, clock: Clock, timeout_s: float = _TIMEOUT_S,
) -> tuple[Sample, Sample, Sample]:
    """Median export, import-to-first-token and their sum for a context of `length` tokens.

    Each repeat moves a fresh in-flight request exactly as a migration does: export
    with abort from the running worker, import on the peer up to its first token.
    """
    from dynamo_ftctl.migrate.transfer import (
        EXPORT_LIMIT,
        export_request,
        fetch,
        stream_completion,
    )

    max_tokens = max(2, min(128, max_model_len - length - 1))
    exports, imports, tokens = [], [], []
    for _ in range(repeats):
        rid = f"ftctl-calibrate-{uuid.uuid4().hex[:12]}"
        reader = await start_in_flight(client, worker, model, length, max_tokens=max_tokens,
                                       request_id=rid, timeout_s=timeout_s)
        try:
            state, payload, export_s = await export_request(client, worker, rid, abort=True,
                                                            clock=clock, timeout_s=timeout_s)
        finally:
            reader.cancel()
        cont = await stream_completion(
            client, peer, "KV import", "POST", f"{peer.admin_url}/admin/kv/import", clock=clock,
            first_only=True, body=payload, timeout_s=timeout_s,
            headers={**peer.admin_headers(), "X-Request-Id": rid,
                     "Content-Type": "application/octet-stream"},
        )
        # Stop the imported copy: it would otherwise decode its remaining tokens.
        await fetch(client, "GET", f"{peer.admin_url}/admin/kv/{rid}?abort=true",
                    headers=peer.admin_headers(), timeout_s=timeout_s, limit=EXPORT_LIMIT)
        exports.append(export_s)
        imports.append(cont.first_token_s)
        tokens.append(len(state.token_ids))
    n = round(statistics.median(tokens))
    return (Sample(tokens=n, seconds=statistics.median(exports)),
            Sample(tokens=n, seconds=statistics.median(imports)),
            Sample(tokens=n, seconds=statistics.median(
                [a + b for a, b in zip(exports, imports, strict=True)])))


async def _layout(client: Client, worker: Endpoint, model: str,
                  timeout_s: float) -> dict[str, int]:
    from dynamo_ftctl.kv.wire import decode_kv
    from dynamo_ftctl.migrate.transfer import EXPORT_LIMIT, fetch, http_errors, refusal

    rid = f"ftctl-calibrate-{uuid.uuid4().hex[:12]}"
    reader = await start_in_flight(client, worker, model, 16, max_tokens=128, request_id=rid,
                                   timeout_s=timeout_s)
    try:
        async with http_errors("KV export", worker):
            status, body = await fetch(
                client, "GET", f"{worker.admin_url}/admin/kv/{rid}?abort=true",
                headers=worker.admin_headers(), timeout_s=timeout_s, limit=EXPORT_LIMIT)
    finally:
        reader.cancel()
    if status != 200:
        raise refusal(worker, "KV export", status, body)
    lay = decode_kv(body).header.layout
    from dynamo_ftctl.kv.layout import dtype_bytes

    return {"layers": lay.num_layers, "kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim,
            "dtype_bytes": dtype_bytes(lay.dtype), "block_size": lay.block_size}


async def calibrate(
    client: Client, worker: Endpoint, peer: Endpoint, *,
    lengths: Sequence[int], repeats: int = 3, clock: Clock = SYSTEM_CLOCK,
    on_progress: Callable[[int, int], None] | None = None,
    timeout_s: float = _TIMEOUT_S,
) -> Calibration:
    """Measure prefill at `lengths` and KV moves worker → peer; fit both models.

    `on_progress(done, total)` follows the timed prefill + KV move pairs;
    `timeout_s` bounds each connection, wait for headers and wait for bytes.
    """
    model, max_len = await _served_model(client, worker, timeout_s)
    usable = [n for n in lengths if n < max_len - 2]
    if len(usable) < 3:
        msg = f"--lengths: need three lengths below the model's maximum of {max_len} tokens"
        raise InvalidInput(msg)
    layout = await _layout(client, worker, model, timeout_s)
    # Warm both paths (allocator, caches, connections) before anything is timed.
    await time_prefill(client, worker, model, usable[-1], clock=clock, timeout_s=timeout_s)
    await time_kv_move(client, worker, peer, model=model, length=usable[0],
                       max_model_len=max_len, repeats=1, clock=clock, timeout_s=timeout_s)
    prefill_samples, move_samples = [], []
    total = len(usable) * repeats
    for step, n in enumerate(usable):
        # One prefill then one KV move per repeat, so that drift in machine load hits
        # both curves alike.
        prefills, moves = [], []
        for r in range(repeats):
            prefills.append(await time_prefill(client, worker, model, n, clock=clock, salt=r,
                                               timeout_s=timeout_s))
            moves.append(await time_kv_move(client, worker, peer, model=model, length=n,
                                            max_model_len=max_len, repeats=1, clock=clock,
                                            timeout_s=timeout_s))
            if on_progress is not None:
                on_progress(step * repeats + r + 1, total)
        prefill_samples.append(Sample(tokens=n, seconds=statistics.median(prefills)))
        move_samples.append(Sample(
            tokens=round(statistics.median(m[2].tokens for m in moves)),
            seconds=statistics.median(m[2].seconds for m in moves)))
    return fit_calibration(Calibration(
        worker=worker.name, peer=peer.name, model=model, layers=layout["layers"],
        kv_heads=layout["kv_heads"], head_dim=layout["head_dim"],
        dtype_bytes=layout["dtype_bytes"], block_size=layout["block_size"],
        prefill=PrefillFit(fixed_s=0.0, per_token_s=1.0),
        transfer=TransferFit(setup_s=0.0, bandwidth_bytes_per_s=1.0),
        measured_at=clock.wall(),
    ), prefill_samples, move_samples)


def fit_calibration(calibration: Calibration, prefill_samples: Sequence[Sample],
            move_samples: Sequence[Sample]) -> Calibration:
    """`calibration` with both models fitted to the samples and its crossovers."""
    from msgspec.structs import replace as evolve

    fitted = evolve(
        calibration, prefill=fit_prefill(prefill_samples),
        transfer=fit_transfer(move_samples, calibration.kv_bytes_per_token),
        prefill_samples=tuple(prefill_samples), transfer_samples=tuple(move_samples))
    return evolve(fitted, crossover_tokens=tuple(round(x) for x in fitted.crossovers()))


# ------------------------------------------------ the vLLM connector's store


def store_prompt(length: int, salt: str) -> list[int]:
    """`length` printable-ASCII byte tokens drawn from `salt`: prompts of distinct salts
    share no leading block (no prefix-cache or store hit between them)."""
    import random

    rng = random.Random(salt)
    return [rng.randrange(32, 127) for _ in range(length)]


async def store_request(
    client: Client, ep: Endpoint, model: str, prompt: Sequence[int], *, load: bool,
    clock: Clock, timeout_s: float = _TIMEOUT_S, max_tokens: int = 1,
) -> tuple[float, dict[str, Any]]:
    """Seconds of one non-streamed greedy completion of `prompt` on a worker with ftctl's
    KV connector, and the connector's report (`loaded_tokens` and the cache geometry).

    `load` False sends `kv_transfer_params.ftctl_load` false: the store loads nothing.
    Raises `InvalidInput` when the answer carries no report (no ftctl connector there).
    """
    from dynamo_ftctl.kv.blockstore import LOAD_PARAM, REPORT_PARAM
    from dynamo_ftctl.migrate.transfer import fetch, http_errors, refusal
    from dynamo_ftctl.openai import completion_request

    params: dict[str, Any] = {REPORT_PARAM: True}
    if not load:
        params[LOAD_PARAM] = False
    body = completion_request(model, prompt, max_tokens=max_tokens, temperature=0.0,
                              extra={"kv_transfer_params": params, "ignore_eos": True})
    started = clock.now()
    async with http_errors("completion", ep):
        status, answer = await fetch(client, "POST", f"{ep.url}/v1/completions",
                                     json.dumps(body).encode(), _JSON, timeout_s=timeout_s)
    seconds = clock.now() - started
    if status != 200:
        raise refusal(ep, "completion", status, answer)
    try:
        report = loads(answer)["kv_transfer_params"][REPORT_PARAM]
        report["loaded_tokens"] = int(report["loaded_tokens"])
    except (ValueError, KeyError, TypeError):
        msg = (f"{ep.name}: the answer carries no report of ftctl's KV connector (is the "
               "worker started with --kv-transfer-config naming FtctlConnector?)")
        raise InvalidInput(msg) from None
    return seconds, report


async def time_store_pair(
    client: Client, worker: Endpoint, peer: Endpoint, *, model: str, length: int,
    salt: str, clock: Clock, timeout_s: float = _TIMEOUT_S,
) -> tuple[float, float]:
    """Seconds to continue a `length`-token context on `peer`: (loaded from the store,
    recomputed). Two fresh prompts are computed on `worker` first (their blocks saved),
    then one is loaded on `peer` and the other sent there with loading turned off.

    Raises `InvalidInput` when the loaded one loaded nothing (the workers do not share a
    store, or the context is shorter than a block and one token) or the other did.
    """
    loaded_prompt = store_prompt(length, f"{salt}-load")
    recomputed_prompt = store_prompt(length, f"{salt}-recompute")
    for prompt in (loaded_prompt, recomputed_prompt):
        # Two tokens: the prompt's blocks are saved in the step after they fill.
        await store_request(client, worker, model, prompt, load=True, clock=clock,
                            timeout_s=timeout_s, max_tokens=2)
    load_s, report = await store_request(client, peer, model, loaded_prompt, load=True,
                                         clock=clock, timeout_s=timeout_s)
    if report["loaded_tokens"] <= 0:
        msg = (f"{peer.name} loaded none of a {length}-token prompt {worker.name} computed: "
               "do the workers share one store, with the same model and flags?")
        raise InvalidInput(msg)
    recompute_s, report = await store_request(client, peer, model, recomputed_prompt,
                                              load=False, clock=clock, timeout_s=timeout_s)
    if report["loaded_tokens"]:
        msg = f"{peer.name} loaded KV for a request sent with ftctl_load false"
        raise InvalidInput(msg)
    return load_s, recompute_s


async def calibrate_store(
    client: Client, worker: Endpoint, peer: Endpoint, *,
    lengths: Sequence[int], repeats: int = 3, clock: Clock = SYSTEM_CLOCK,
    on_progress: Callable[[int, int], None] | None = None,
    timeout_s: float = _TIMEOUT_S,
) -> Calibration:
    """Measure, on workers sharing ftctl's KV connector's store, how long a continuation
    of each of `lengths` context tokens takes on `peer` loaded from the store and
    recomputed; fit both (`via="store"`). `worker` computes the prompts first; it may be
    `peer` only where its prefix cache is off. Lengths below two blocks are refused
    (nothing to load), as are fewer than three usable.
    """
    model, max_len = await _served_model(client, worker, timeout_s)
    salt = uuid.uuid4().hex  # a run of its own: nothing left in the store by another
    _, report = await store_request(client, worker, model, store_prompt(8, salt), load=True,
                                    clock=clock, timeout_s=timeout_s)
    geometry = {key: int(report.get(key) or 0) for key in
                ("layers", "kv_heads", "head_dim", "dtype_bytes", "block_size")}
    if min(geometry.values()) < 1:
        msg = f"{worker.name}: the KV connector reported no cache geometry ({report})"
        raise InvalidInput(msg)
    usable = [n for n in lengths if 2 * geometry["block_size"] <= n < max_len - 2]
    if len(usable) < 3:
        msg = (f"--lengths: need three lengths from two blocks ({2 * geometry['block_size']} "
               f"tokens) to below the model's maximum of {max_len} tokens")
        raise InvalidInput(msg)
    # Warm both ways at every length (allocator, per-shape kernels, caches, connections)
    # before anything is timed; then rounds over all lengths, so that drift in the
    # machine's load hits every length alike.
    for n in usable:
        await time_store_pair(client, worker, peer, model=model, length=n,
                              salt=f"{salt}-warm-{n}", clock=clock, timeout_s=timeout_s)
    loads: dict[int, list[float]] = {n: [] for n in usable}
    recomputes: dict[int, list[float]] = {n: [] for n in usable}
    total = len(usable) * repeats
    for r in range(repeats):
        for step, n in enumerate(usable):
            load_s, recompute_s = await time_store_pair(
                client, worker, peer, model=model, length=n, salt=f"{salt}-{n}-{r}",
                clock=clock, timeout_s=timeout_s)
            loads[n].append(load_s)
            recomputes[n].append(recompute_s)
            if on_progress is not None:
                on_progress(r * len(usable) + step + 1, total)
    load_samples = [Sample(tokens=n, seconds=statistics.median(loads[n])) for n in usable]
    recompute_samples = [Sample(tokens=n, seconds=statistics.median(recomputes[n]))
                         for n in usable]
    return fit_calibration(Calibration(
        worker=worker.name, peer=peer.name, model=model, layers=geometry["layers"],
        kv_heads=geometry["kv_heads"], head_dim=geometry["head_dim"],
        dtype_bytes=geometry["dtype_bytes"], block_size=geometry["block_size"],
        prefill=PrefillFit(fixed_s=0.0, per_token_s=1.0),
        transfer=TransferFit(setup_s=0.0, bandwidth_bytes_per_s=1.0),
        measured_at=clock.wall(), via="store",
    ), recompute_samples, load_samples)


@dataclass(frozen=True)
class CalibrationResult:
    """A calibration, where it was saved, and the crossover it predicts."""

    path: Path
    calibration: Calibration
    crossover_tokens: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON."""
        return {"path": str(self.path), "crossover_tokens": list(self.crossover_tokens),
                "calibration": to_data(self.calibration)}

    def __rich__(self) -> Group:
        from rich.console import Group

        from dynamo_ftctl.output import kv_table, table

        c = self.calibration
        moves = {s.tokens: s.seconds for s in c.transfer_samples}
        rows = [(s.tokens, f"{s.seconds * 1e3:.2f}",
                 f"{moves[s.tokens] * 1e3:.2f}" if s.tokens in moves else "-")
                for s in c.prefill_samples]
        recompute, move = ("recompute", "store load") if c.via == "store" \
            else ("prefill", "KV move")
        summary = {
            "saved": str(self.path),
            recompute: f"{c.prefill.fixed_s * 1e3:.3g} ms + n × {c.prefill.per_token_s * 1e6:.3g}"
                       f" µs + n² × {c.prefill.per_token2_s * 1e9:.3g} ns",
            move: f"{c.transfer.setup_s * 1e3:.3g} ms + "
                       f"{c.transfer.bandwidth_bytes_per_s / 1e9:.3g} GB/s "
                       f"({c.kv_bytes_per_token} B/token)",
            "crossover": ", ".join(f"{n} tokens" for n in self.crossover_tokens) or "none",
        }
        return Group(
            kv_table(f"calibration of {c.worker} → {c.peer} ({c.model})", summary),
            table("measured (median)", ["context tokens", f"{recompute} ms", f"{move} ms"],
                  rows),
        )


def calibrate_workers(
    inventory: Inventory, *, worker: str, peer: str | None, lengths: Sequence[int],
    repeats: int, output: Path, timeout_s: float = _TIMEOUT_S,
    on_progress: Callable[[int, int], None] | None = None, via: str = "export",
) -> CalibrationResult:
    """Calibrate inventory workers and save the file (the CLI's entry): `via` "export"
    (`calibrate`) or "store" (`calibrate_store`)."""
    if via not in ("export", "store"):
        msg = f"--via must be export or store (got {via!r})"
        raise InvalidInput(msg)
    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.migrate.transfer import endpoint_for
    from dynamo_ftctl.output import check_output_path

    check_output_path(output)  # a bad --output is refused before the measurements
    src = endpoint_for(inventory, worker)
    dst = endpoint_for(inventory, peer) if peer else src

    async def run() -> Calibration:
        client = Client()
        try:
            measure = calibrate_store if via == "store" else calibrate
            return await measure(client, src, dst, lengths=lengths, repeats=repeats,
                                 on_progress=on_progress, timeout_s=timeout_s)
        finally:
            await client.close()

    calibration = asyncio.run(run())
    save_calibration(calibration, output)
    return CalibrationResult(path=output, calibration=calibration,
                             crossover_tokens=calibration.crossover_tokens)


# ------------------------------------------------------------------ planning


@dataclass(frozen=True)
class PlanOverrides:
    """`ftctl migrate plan`'s options, for `plan_from_options`."""

    model: str = "llama-3-70b"
    tp: int = 1
    tokens: int = 32768
    link: str = "nvlink4"
    bandwidth_gb_per_s: float | None = None
    setup_ms: float | None = None
    block_size: int = 16
    dtype: str = "fp16"
    gpu: str = "h100"
    mfu: float = 0.5
    prefill_tokens_per_s: float | None = None
    calibration: Path | None = None
    table: bool = False


def plan_from_options(o: PlanOverrides) -> MigrationPlan | PlanTable:
    """One plan (or a contexts × links table) from presets, overrides and a calibration.

    A calibration replaces the model geometry, the prefill model and the link
    with the measured ones; explicit overrides still win.
    """
    if o.bandwidth_gb_per_s is not None and o.bandwidth_gb_per_s <= 0:
        msg = f"--bandwidth must be > 0 GB/s (got {o.bandwidth_gb_per_s})"
        raise InvalidInput(msg)
    if o.setup_ms is not None and o.setup_ms < 0:
        msg = f"--setup-ms must be >= 0 (got {o.setup_ms})"
        raise InvalidInput(msg)
    gpu = GPUS.get(o.gpu.lower())
    if gpu is None:
        msg = f"unknown GPU {o.gpu!r} (known: {', '.join(GPUS)})"
        raise InvalidInput(msg)
    preset = model_preset(o.model).with_dtype(o.dtype)
    link = link_preset(o.link)
    prefill: PrefillModel | None = None
    source = None
    tp = o.tp
    if o.calibration is not None:
        cal = load_calibration(o.calibration)
        preset, link, prefill, tp = cal.model_preset(), cal.link(), cal.prefill_model(), 1
        source = f"calibrated ({o.calibration})"
    if o.prefill_tokens_per_s is not None:
        if o.prefill_tokens_per_s <= 0:
            msg = "--prefill-tokens-per-s must be > 0"
            raise InvalidInput(msg)
        base = prefill or PrefillModel.from_flops(preset, tp, gpu, o.mfu)
        prefill = replace(base, per_token_s=1.0 / o.prefill_tokens_per_s)
        source = f"{o.prefill_tokens_per_s:g} tokens/s + attention term"
    if o.bandwidth_gb_per_s is not None:
        link = replace(link, bandwidth=o.bandwidth_gb_per_s * 1e9)
    if o.setup_ms is not None:
        link = replace(link, setup_s=o.setup_ms / 1e3)
    if o.table:
        from dynamo_ftctl.migrate.cost import LINKS

        links = [link] if o.calibration or o.bandwidth_gb_per_s else list(LINKS.values())
        if o.setup_ms is not None:
            links = [replace(x, setup_s=o.setup_ms / 1e3) for x in links]
        return plan_table(preset, tp=tp, links=links, block_size=o.block_size,
                          prefill=prefill, gpu=gpu, mfu=o.mfu)
    return plan_migration(preset, tp=tp, tokens=o.tokens, link=link, block_size=o.block_size,
                          prefill=prefill, gpu=gpu, mfu=o.mfu, prefill_source=source)
