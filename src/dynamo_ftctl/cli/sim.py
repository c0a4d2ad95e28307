"""`ftctl sim`: run the reference engine, or a local cluster of them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode, load_inventory_for

__all__ = ["app"]

app = typer.Typer(
    help=(
        "The reference engine: a deterministic tiny torch transformer with a paged KV cache "
        "behind an OpenAI-compatible server (vLLM-style /health, /metrics, /sleep, "
        "KV export/import and an admin fault endpoint), and a local cluster launcher."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)


@app.callback()
def sim() -> None:
    """Run the reference engine, or a local cluster of them."""


@app.command()
def serve(  # noqa: PLR0917 (typer passes options by keyword; one per flag)
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port; 0 picks a free one.")] = 0,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    seed: Annotated[int, typer.Option(help="Weight seed: same seed, same model.")] = 0,
    model_config: Annotated[str, typer.Option(
        "--model-config", help="Preset name (ftctl-sim-tiny) or an engine config YAML.",
    )] = "ftctl-sim-tiny",
    served_model_name: Annotated[str | None, typer.Option(
        help="Model id to serve (default: the config's name).")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Override the max model length.")]
    = None,
    num_blocks: Annotated[int | None, typer.Option(help="Override the KV block pool size.")]
    = None,
    device: Annotated[str, typer.Option(help="torch device: cpu, cuda, cuda:1.")] = "cpu",
    threads: Annotated[int, typer.Option(help="torch threads (0: torch's default).")] = 1,
    pid_file: Annotated[Path | None, typer.Option(help="Write the pid here once serving.")]
    = None,
    admin_token_env: Annotated[str, typer.Option(
        help="Environment variable holding the admin bearer token (/admin/*, /sleep, "
        "/wake_up; unset: those answer 403).",
    )] = "FTCTL_ADMIN_TOKEN",  # noqa: S107 (a variable name, not a secret)
    fault: Annotated[list[str] | None, typer.Option(
        "--fault", help="Start with a fault: KIND[:key=value,...], e.g. slow:delay_ms=50, "
        "disconnect:after_tokens=20, sdc, crash:xid=48,after_s=5, hang:after_s=5.",
    )] = None,
    pci_bus_id: Annotated[str, typer.Option(help="PCI bus id shown in Xid crash lines.")]
    = "0000:3b:00",
    tokenizer: Annotated[str | None, typer.Option(
        help="bpe (default: a byte-level BPE; re-tokenizing generated text gives other ids, "
        "as on real engines) or byte (one id per byte, exact round trips).",
        show_default=False)] = None,
    warmup_s: Annotated[float, typer.Option(
        "--warmup-s", min=0, help="Extra delay of the first generation request, as real "
        "engines warm up (/health answers meanwhile); 0: none.")] = 1.0,
    lenient_fields: Annotated[bool, typer.Option(
        "--lenient-fields", help="Ignore unknown request fields (default: 400 naming the "
        "field, as vLLM's strict validation does).")] = False,
    nondeterministic: Annotated[bool, typer.Option(
        "--nondeterministic", help="Answer greedy requests with a random pick among the "
        "likeliest tokens (same length, other text each time), as Dynamo's mocker does; "
        "the config's nondeterministic: true.")] = False,
    request_timeout_s: Annotated[float, typer.Option(
        "--request-timeout-s", min=0.1, help="A request not received whole within this "
        "many seconds of its first byte is answered 408 (slow or stalled clients).")] = 30.0,
    dynamo: Annotated[bool, typer.Option(
        "--dynamo", help="Stream as NVIDIA Dynamo's frontend does: no token ids "
        "(return_token_ids is ignored), an nvext object in every chunk, the prompt's ids in "
        "an `event: token_ids` block first; a token that ends inside a character sends an "
        "empty chunk and its text comes with the next.")] = False,
) -> None:
    """Serve the engine; prints its URL on stdout once it answers requests.

    Example: FTCTL_ADMIN_TOKEN=secret ftctl sim serve --port 8101 --seed 0
    """
    from dynamo_ftctl.engine.config import resolve_engine_config
    from dynamo_ftctl.engine.faults import parse_fault_flag
    from dynamo_ftctl.engine.server import ServerSettings
    from dynamo_ftctl.engine.server import serve as run

    config = resolve_engine_config(model_config, name=served_model_name,
                                   max_model_len=max_model_len, num_blocks=num_blocks,
                                   tokenizer=tokenizer,
                                   nondeterministic=True if nondeterministic else None)
    settings = ServerSettings(
        config=config, seed=seed, host=host, port=port, device=device,
        admin_token=os.environ.get(admin_token_env) or None,
        faults=tuple(parse_fault_flag(f) for f in fault or ()), pci_bus_id=pci_bus_id,
        pid_file=pid_file, threads=threads or None, warmup_s=warmup_s,
        lenient_fields=lenient_fields, request_timeout_s=request_timeout_s, dynamo=dynamo,
    )

    def ready(url: str) -> None:
        sys.stdout.write(url + "\n")
        sys.stdout.flush()

    raise typer.Exit(run(settings, on_ready=ready))


StateDir = Annotated[Path | None, typer.Option(
    "--state-dir", help="Pid files and logs (default: $FTCTL_STATE_DIR, $XDG_RUNTIME_DIR/ftctl, "
    "or /tmp/ftctl-UID; one folder per cluster). `ftctl inject` finds a worker's pid in "
    "the default one.", show_default=False,
)]


@app.command()
def cluster(
    ctx: typer.Context,
    state_dir: StateDir = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for every worker.")] = 60.0,
    json_: JsonFlag = False,
) -> None:
    """Start every worker with launch.sim as its own engine; serve until Ctrl-C, then stop all.

    Example: ftctl sim cluster -i examples/local.yaml
    """
    from dynamo_ftctl.engine.launcher import ClusterStatus, run_cluster
    from dynamo_ftctl.output import emit, warn

    inventory = load_inventory_for(ctx)
    as_json = json_mode(ctx, json_)

    def ready(status: ClusterStatus) -> None:
        emit(status, json_mode=as_json)
        sys.stdout.flush()
        if not as_json:
            sys.stderr.write("serving; Ctrl-C or `ftctl sim stop` stops every worker\n")

    def died(name: str, code: int) -> None:
        warn(f"worker {name} exited with code {code}")

    run_cluster(inventory, state_dir=state_dir, timeout_s=timeout, on_ready=ready,
                on_exit=died)


@app.command()
def stop(
    ctx: typer.Context,
    state_dir: StateDir = None,
    timeout: Annotated[float, typer.Option(help="Seconds before SIGKILL.")] = 5.0,
    json_: JsonFlag = False,
) -> None:
    """Stop the workers `ftctl sim cluster` started (found through their pid files).

    Example: ftctl sim stop -i examples/local.yaml
    """
    from dynamo_ftctl.engine.launcher import stop_cluster

    result = stop_cluster(load_inventory_for(ctx), state_dir=state_dir, timeout_s=timeout)
    finish(ctx, result, json_flag=json_)
