"""`ftctl migrate`: plan, calibrate and perform request migration (KV transfer or re-prefill)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode, load_inventory_for
from dynamo_ftctl.cli.completion import complete_worker

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Move a request's KV cache or re-prefill it: the cost model (plan), measured rates "
        "(calibrate) and the move itself (request)."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)

CalibrationOpt = Annotated[
    Path | None,
    typer.Option("--calibration", "-c",
                 help="Calibration file from `ftctl migrate calibrate` (measured rates)."),
]


@app.command()
def plan(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    model: Annotated[str, typer.Option(
        help="llama-3-8b, llama-3-70b, llama-3-405b, mixtral-8x7b, qwen2.5-72b, deepseek-v3.",
    )] = "llama-3-70b",
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel degree.")] = 1,
    tokens: Annotated[int, typer.Option(min=0, help="Context tokens to move.")] = 32768,
    link: Annotated[str, typer.Option(
        help="nvlink3, nvlink4, nvlink5, pcie4, pcie5, ib-ndr, ib-xdr, tcp.")] = "nvlink4",
    bandwidth: Annotated[float | None, typer.Option(
        help="Override the link bandwidth, GB/s per direction.")] = None,
    setup_ms: Annotated[float | None, typer.Option(
        help="Override the per-transfer setup latency, ms.")] = None,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block.")] = 16,
    dtype: Annotated[str, typer.Option(help="KV dtype: fp16, bf16, fp8, fp32.")] = "fp16",
    gpu: Annotated[str, typer.Option(help="GPU for the FLOP prefill model: a100, h100, "
                                          "h200, b200.")] = "h100",
    mfu: Annotated[float, typer.Option(help="Prefill fraction of peak FLOPs.")] = 0.5,
    prefill_tokens_per_s: Annotated[float | None, typer.Option(
        help="Override the prefill throughput (linear term), tokens/s.")] = None,
    calibration: CalibrationOpt = None,
    table: Annotated[bool, typer.Option(
        "--table", help="A table of contexts × links instead of one plan.")] = False,
    json_: JsonFlag = False,
) -> None:
    """Cost KV transfer against re-prefill for one request and say which is faster.

    Example: ftctl migrate plan --model llama-3-70b --tp 8 --tokens 32768 --link nvlink4
    """
    from dynamo_ftctl.migrate.calibrate import PlanOverrides, plan_from_options

    result = plan_from_options(PlanOverrides(
        model=model, tp=tp, tokens=tokens, link=link, bandwidth_gb_per_s=bandwidth,
        setup_ms=setup_ms, block_size=block_size, dtype=dtype, gpu=gpu, mfu=mfu,
        prefill_tokens_per_s=prefill_tokens_per_s, calibration=calibration, table=table,
    ))
    finish(ctx, result, json_flag=json_)


@app.command()
def calibrate(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    worker: Annotated[str, typer.Option(help="Worker whose prefill rate is measured.",
                                        autocompletion=complete_worker)],
    to: Annotated[str | None, typer.Option(
        "--to", help="Peer worker for KV export/import bandwidth (default: the same worker).",
        autocompletion=complete_worker,
    )] = None,
    lengths: Annotated[str, typer.Option(
        help="Prompt lengths to time, tokens, comma-separated.")] = "16,64,128,256,384,512",
    repeats: Annotated[int, typer.Option(min=1, help="Runs per length (median).")] = 3,
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Calibration file to write (a regular file or a new path, "
        "checked before measuring).")] = Path("ftctl-calibration.json"),
    timeout: Annotated[float, typer.Option(min=0.1, help="Per-request timeout, s.")] = 60.0,
    via: Annotated[str, typer.Option(
        help="export: KV moves by /admin/kv export and import (ftctl sim); store: the "
        "workers share ftctl's vLLM KV connector's store, and the load from it is timed "
        "against recompute (lengths from two blocks up).")] = "export",
    json_: JsonFlag = False,
) -> None:
    """Measure a worker's prefill rate and KV export/import bandwidth (or, --via store, the
    KV connector's store load against recompute); fit and save the model.

    Example: ftctl -i examples/local.yaml migrate calibrate --worker w1 --to w2
    """
    from dynamo_ftctl.migrate.calibrate import calibrate_workers, parse_lengths
    from dynamo_ftctl.output import progress

    inventory = load_inventory_for(ctx)
    with progress(f"calibrating {worker}", quiet=json_mode(ctx, json_)) as line:
        result = calibrate_workers(
            inventory, worker=worker, peer=to, lengths=parse_lengths(lengths), repeats=repeats,
            output=output, timeout_s=timeout, on_progress=line.update, via=via,
        )
    finish(ctx, result, json_flag=json_)


@app.command()
def request(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    request_id: Annotated[str, typer.Option("--request-id", help="The in-flight request.")],
    source: Annotated[str, typer.Option("--from", help="Worker that holds the request.",
                                        autocompletion=complete_worker)],
    target: Annotated[str, typer.Option("--to", help="Worker to move it to.",
                                        autocompletion=complete_worker)],
    method: Annotated[str, typer.Option(
        help="auto, kv or reprefill (kv falls back to reprefill on a target without a KV "
             "import API, and says so).")] = "auto",
    calibration: CalibrationOpt = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Per-call timeout, s.")] = 60.0,
    json_: JsonFlag = False,
) -> None:
    """Move one in-flight request by KV transfer or by re-prefill (the source needs a KV
    export API: ftctl sim; from vLLM, exit 2: use ftctl proxy).

    Example: ftctl -i examples/local.yaml migrate request --request-id r1 --from w1 --to w2
    """
    from dynamo_ftctl.migrate.calibrate import load_calibration
    from dynamo_ftctl.migrate.transfer import migrate_request_sync

    inventory = load_inventory_for(ctx)
    result = migrate_request_sync(
        inventory, request_id=request_id, source=source, target=target, method=method,
        calibration=load_calibration(calibration) if calibration is not None else None,
        timeout_s=timeout,
    )
    finish(ctx, result, json_flag=json_)
