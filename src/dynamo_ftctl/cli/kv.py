"""`ftctl kv`: benchmark the paged KV block copier."""

from __future__ import annotations

from typing import Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Paged KV blocks: copy bandwidth of the block copier (host: the native row-copy "
        "kernel; devices: gather → pinned staging → copy stream → scatter) against one "
        "contiguous copy of the same bytes."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)


@app.callback()
def kv() -> None:
    """Paged KV blocks: copier bandwidth and the chunk-size sweep."""


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        msg = f"{flag}: expected comma-separated integers, got {text!r}"
        raise typer.BadParameter(msg) from None
    if any(v <= 0 for v in values):
        msg = f"{flag}: every value must be > 0"
        raise typer.BadParameter(msg)
    return values


@app.command()
def bench(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    device: Annotated[str, typer.Option(help="cpu, or cuda (D2D, D2H and H2D).")] = "cpu",
    layers: Annotated[int, typer.Option(min=1, help="Layers (one cache tensor each).")] = 1,
    blocks: Annotated[str, typer.Option(help="Block counts to copy, comma-separated.")] = (
        "1000,10000,100000"),
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per block.")] = 16,
    kv_heads: Annotated[int, typer.Option(min=1, help="KV heads per block.")] = 1,
    head_dim: Annotated[int, typer.Option(min=1, help="Head dimension.")] = 64,
    dtype: Annotated[str, typer.Option(help="fp16, bf16, fp32 or fp8.")] = "fp16",
    layout: Annotated[str, typer.Option(
        help="Cache layout: vllm [num_blocks, 2, ...] or flash [2, num_blocks, ...].")] = "vllm",
    chunk_kib: Annotated[int, typer.Option(min=1, help="Staging slot size, KiB.")] = 1024,
    sweep_kib: Annotated[str, typer.Option(
        help="Chunk sizes to sweep, KiB, comma-separated ('' skips the sweep).")] = (
        "64,256,1024,4096,16384"),
    sweep_blocks: Annotated[int, typer.Option(min=1, help="Blocks copied in the sweep.")] = 10000,
    patterns: Annotated[str, typer.Option(
        help="Block-id patterns, comma-separated: gather (random -> a run, an export), "
             "scatter (a run -> random, an import), random (random -> random).")] = (
        "gather,scatter,random"),
    repeats: Annotated[int, typer.Option(min=1, help="Runs per measurement (median).")] = 5,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
    kernel: Annotated[str, typer.Option(
        help="Host copy kernel: auto (the native row-copy kernel when the wheel ships it "
             "or a C compiler builds it on first use), native, or torch "
             "(index_select/index_copy_ and staging).")] = "auto",
    cache: Annotated[str, typer.Option(
        help="Host caches at the start of each timed run, copier and baseline alike: warm "
             "(runs back to back) or cold (evicted first by reading twice the last-level "
             "cache).")] = "warm",
    json_: JsonFlag = False,
) -> None:
    """Copier bandwidth vs one contiguous copy_ of the same bytes, plus a chunk-size sweep.

    Exit 3 when --device cuda is asked for and no CUDA device is present; exit 2 for
    --kernel native when the row-copy kernel is not available (no C compiler).

    Example: ftctl kv bench --blocks 1000,10000,100000 --repeats 5
    """
    from dynamo_ftctl.kv.bench import run_kv_bench
    from dynamo_ftctl.output import progress

    with progress("measuring KV copies", quiet=json_mode(ctx, json_)) as line:
        result = run_kv_bench(
            device=device, layers=layers, blocks=_ints(blocks, "--blocks"),
            block_size=block_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
            layout=layout, chunk_bytes=chunk_kib * 1024,
            sweep_chunks=[k * 1024 for k in _ints(sweep_kib, "--sweep-kib")],
            sweep_blocks=sweep_blocks, repeats=repeats, threads=threads, kernel=kernel,
            cache=cache, patterns=[p for p in patterns.replace(" ", "").split(",") if p],
            on_progress=line.update,
        )
    finish(ctx, result, json_flag=json_)
