"""`ftctl canary`: canary probes (one-shot), the health daemon (--watch), record a set."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, global_options, json_mode
from dynamo_ftctl.cli._light import optional_inventory
from dynamo_ftctl.cli.completion import complete_worker

if TYPE_CHECKING:
    from dynamo_ftctl.inventory import Inventory

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Canary requests with known answers: catch workers that look alive but are broken.\n\n"
        "One-shot (Kubernetes exec probe, cron): ftctl canary --worker w3 (or --all, or --url "
        "URL --set FILE without an inventory). Exit 0 healthy, 1 unhealthy (token mismatch, "
        "logit drift, latency spike, garbage answer; with a shape set, an answer off its "
        "recorded shape), 3 unreachable or timed out, 2 bad input. Reports name the kind of "
        "set that judged: a shape set detects a dead or broken worker, not wrong answers.\n\n"
        "Daemon: ftctl canary --watch probes every worker each canary.interval_s, keeps the "
        "state machine and breakers, serves GET /workers, POST /report, /metrics, /health. "
        "POST /report needs Authorization: Bearer $FTCTL_DAEMON_TOKEN (or the variable "
        "canary.token_env names; unset: reports refused with 403), at most canary.report_burst "
        "at once and canary.report_rate_per_s a second per client address (429 beyond); a "
        "report can only lower a worker's health, a passing probe restores it."
    ),
    invoke_without_command=True,
    no_args_is_help=False,
    rich_markup_mode=None,
)

SetOption = Annotated[
    Path | None,
    typer.Option("--set", help="Canary set YAML (default: the inventory's canary.set).",
                 show_default=False),
]


def _inventory(ctx: typer.Context, *, required: bool) -> Inventory | None:
    """The inventory, or None when none was named and ./ftctl.yaml does not exist."""
    return optional_inventory(global_options(ctx).inventory, required=required)


def _print_transition(record: Any) -> None:
    from dynamo_ftctl.output import emit_line

    emit_line(record)


@app.callback()
def canary(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    worker: Annotated[
        list[str] | None,
        typer.Option("--worker", "-w", help="Inventory worker to probe (repeatable).",
                     show_default=False, autocompletion=complete_worker),
    ] = None,
    all_workers: Annotated[bool, typer.Option("--all", help="Probe every worker.")] = False,
    url: Annotated[
        str | None,
        typer.Option("--url", help="Probe this OpenAI-compatible base URL (no inventory).",
                     show_default=False),
    ] = None,
    set_path: SetOption = None,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", min=0.001, help="Per-request timeout in seconds "
                     "(default: canary.timeout_s).", show_default=False),
    ] = None,
    state_file: Annotated[
        Path | None,
        typer.Option("--state-file", help="Latency baseline file (default: canary.state_file, "
                     "then $XDG_STATE_HOME/ftctl/canary.json).", show_default=False),
    ] = None,
    no_state: Annotated[
        bool, typer.Option("--no-state", help="No latency baseline (no spike verdicts)."),
    ] = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="Run the health daemon over every worker."),
    ] = False,
    listen: Annotated[
        str | None,
        typer.Option("--listen", help="Daemon HOST:PORT (default: canary.listen; port 0: any).",
                     show_default=False),
    ] = None,
    acting_lock: Annotated[
        Path | None,
        typer.Option("--acting-lock", help="Daemon: a lock file on a volume several daemons "
                     "share; only its holder runs the actions, the others probe, serve "
                     "/workers and take over when it dies (default: canary.acting_lock).",
                     show_default=False),
    ] = None,
    json_: JsonFlag = False,
) -> None:
    """Probe workers once (exit 0/1/3), or run the health daemon with --watch.

    Example: ftctl -i examples/local.yaml canary --worker w1
    """
    if ctx.invoked_subcommand is not None:
        return
    as_json = json_mode(ctx, json_)
    if watch:
        _watch(ctx, set_path=set_path, listen=listen, state_file=state_file,
               use_state=not no_state, as_json=as_json, acting_lock=acting_lock)
        return
    from dynamo_ftctl.cli.probe import probe_once

    # The same call as the console script's fast path (cli/probe.py).
    raise typer.Exit(probe_once(inventory=global_options(ctx).inventory, workers=worker or (),
                                all_workers=all_workers, url=url, set_path=set_path,
                                timeout_s=timeout, state_file=state_file,
                                use_state=not no_state, as_json=as_json))


def _watch(ctx: typer.Context, *, set_path: Path | None, listen: str | None,
           state_file: Path | None, use_state: bool, as_json: bool,
           acting_lock: Path | None = None) -> None:
    from dynamo_ftctl.auth import token_from_env
    from dynamo_ftctl.health.run import watch_fleet
    from dynamo_ftctl.output import warn

    inventory = _inventory(ctx, required=True)
    assert inventory is not None
    live = not as_json and sys.stdout.isatty()

    def ready(url: str) -> None:
        sys.stderr.write(f"canary daemon: {len(inventory.workers)} workers, serving {url}\n")
        sys.stderr.flush()
        if token_from_env(inventory.canary.token_env) is None:
            warn(f"${inventory.canary.token_env} is not set: POST /report is refused (403)")

    summary = watch_fleet(inventory, set_path=set_path, listen=listen, state_file=state_file,
                          use_state=use_state, on_transition=None if live else _print_transition,
                          on_action=None if live else _print_transition, on_ready=ready,
                          live=live, acting_lock=acting_lock)
    sys.stderr.write(f"canary daemon stopped after {summary.rounds} rounds, "
                     f"{summary.probes} probes, {summary.transitions} transitions\n")


@app.command()
def record(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    worker: Annotated[
        str | None,
        typer.Option("--worker", "-w", help="Inventory worker known to be good.",
                     show_default=False, autocompletion=complete_worker),
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="Or a base URL (needs --model).",
                                 show_default=False),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model id (default: the worker's).",
                                 show_default=False),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Where to write (default: canaries/<model>.yaml, "
                     "each '/' of the model id written '--': one name inside canaries/): a "
                     "regular file or a new path, not in a directory named through a link, "
                     "checked before recording.",
                     show_default=False),
    ] = None,
    repeats: Annotated[
        int | None,
        typer.Option("--repeats", min=2, help="Runs per prompt, all of which must agree "
                     "(default 3); with --shape, the answers measured (default 5).",
                     show_default=False),
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096)] = 8,
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", help="NAME=TEXT (repeatable; default: a built-in set).",
                     show_default=False),
    ] = None,
    warmup_timeout: Annotated[
        float, typer.Option("--warmup-timeout", min=0,
                            help="Seconds the first (warm-up) request may take; a fresh engine "
                            "answers its first request late. 0: no warm-up request."),
    ] = 120.0,
    shape: Annotated[
        bool,
        typer.Option("--shape", help="Record a shape set (kind: shape) for a worker whose "
                     "greedy answers vary: per prompt a non-empty answer, its finish reasons, "
                     "a token-count range and latency baselines. Weaker: it detects a dead or "
                     "broken worker, not wrong answers."),
    ] = False,
    latency_tolerance: Annotated[
        float | None,
        typer.Option("--latency-tolerance", min=1.0, max=1000.0,
                     help="With --shape: an answer fails past this many times its recorded "
                     "time to first token or total latency (default 4).", show_default=False),
    ] = None,
    json_: JsonFlag = False,
) -> None:
    """Record a golden canary set from a good worker (refuses if answers differ; --shape
    records the shape of the answers instead).

    Example: ftctl -i examples/local.yaml canary record -w w1 -o canaries/ftctl-sim-tiny.yaml
    """
    from dynamo_ftctl.health.run import record_set
    from dynamo_ftctl.output import progress

    prompts = []
    for item in prompt or ():
        name, sep, text = item.partition("=")
        if not sep or not name or not text:
            msg = f"--prompt expects NAME=TEXT, got {item!r}"
            raise typer.BadParameter(msg, param_hint="--prompt")
        prompts.append((name, text))
    inventory = _inventory(ctx, required=url is None)
    with progress("recording the canary set", quiet=json_mode(ctx, json_)) as line:

        def warming(deadline_s: float) -> None:
            line.print(f"waiting up to {deadline_s:g} s for the worker to warm up "
                       "(first request)...")
            line.note("warm-up request")

        def asked(done: int, total: int) -> None:
            line.update(done, total, note="recording the canary set")

        result = record_set(inventory, worker=worker, url=url, model=model, out=out,
                            repeats=repeats, max_tokens=max_tokens, prompts=prompts or None,
                            warmup_timeout_s=warmup_timeout, on_warmup=warming,
                            on_progress=asked, shape=shape,
                            latency_tolerance=latency_tolerance)
    finish(ctx, result, json_flag=json_)
