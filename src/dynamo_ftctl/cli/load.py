"""`ftctl load`: open-loop load with honest latencies, SLO sweeps, and report comparison."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode, load_inventory_for
from dynamo_ftctl.cli.completion import complete_worker_list
from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from dynamo_ftctl.loadgen import LoadConfig, LoadEvent

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Generate load against OpenAI-compatible endpoints and measure it honestly.\n\n"
        "Open loop (--rate): arrivals are planned ahead and latencies are measured from "
        "each request's planned send time, so a slow server cannot hide its latency. "
        "Closed loop (--users): N users back to back. Every run is bounded by --duration "
        "and/or --requests. --procs N shares one planned schedule among N processes; "
        "--shard I/N runs one share on this machine from a common --start-at, and "
        "`ftctl load merge` merges the shares' --out directories. Exit 0 done, 1 aborted "
        "or SLO missed, 2 bad input, 3 every request failed to connect."
    ),
    invoke_without_command=True,
    rich_markup_mode=None,
)


def _split(values: list[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for raw in values or () for v in raw.split(",") if v.strip())


def _sweep_bounds(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError(text)
        return float(low), float(high)
    except ValueError:
        msg = f"--sweep: {text!r} is not LOW:HIGH requests/s (e.g. 10:400)"
        raise InvalidInput(msg) from None


def _progress_hook(planned: int | None) -> tuple[Any, Any]:
    """A rich live line on stderr, or nothing when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None, None
    from rich.live import Live
    from rich.text import Text

    from dynamo_ftctl.loadgen.render import render_progress
    from dynamo_ftctl.output import stderr_console

    def line(text: str) -> Text:  # one line, cut at the terminal's width, never wrapped
        return Text(text, no_wrap=True, overflow="ellipsis")

    # Other stderr writes (warnings, logs) go through sys.stderr, which Live redirects
    # above the status line while it runs, so they never run into it.
    live = Live(line("ftctl load: starting…"), console=stderr_console(), transient=True,
                refresh_per_second=4, redirect_stderr=True)

    def on_event(event: LoadEvent) -> None:
        if event.progress is not None:
            live.update(line(render_progress(event.progress, planned=planned)))
        elif event.kind == "aborted" and event.message:
            live.console.print(f"ftctl load: aborting: {event.message}")

    return live, on_event


@app.callback()
def load(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    url: Annotated[list[str] | None, typer.Option(
        "--url", help="Target base URL (repeat or comma-separate for several).")] = None,
    workers: Annotated[str | None, typer.Option(
        "--workers", help="Inventory workers to target, comma-separated (with -i).",
        autocompletion=complete_worker_list)] = None,
    inventory: Annotated[Path | None, typer.Option(
        "--inventory", "-i", help="Inventory for --workers (default: the root -i).")] = None,
    rate: Annotated[float | None, typer.Option(
        "--rate", help="Open loop: requests per second.")] = None,
    users: Annotated[int | None, typer.Option(
        "--users", help="Closed loop: number of concurrent users.")] = None,
    arrival: Annotated[str, typer.Option(
        "--arrival", help="Open-loop arrivals: poisson, constant or gamma.")] = "poisson",
    burstiness: Annotated[float, typer.Option(
        "--burstiness",
        help="Gamma shape: 1 is Poisson, <1 burstier, >1 more even.")] = 1.0,
    ramp_to: Annotated[float | None, typer.Option(
        "--ramp-to", help="Ramp the rate to this many requests/s over the duration.")] = None,
    ramp_steps: Annotated[int, typer.Option(
        "--ramp-steps", help="Ramp in this many equal steps (0: linear).")] = 0,
    concurrency: Annotated[int | None, typer.Option(
        "--concurrency", help="Open loop: cap on requests in flight (waits count).")] = None,
    duration: Annotated[str | None, typer.Option(
        "--duration", help="How long to send: 60, 60s, 500ms, 2m.")] = None,
    requests: Annotated[int | None, typer.Option(
        "--requests", help="How many requests to send.")] = None,
    warmup: Annotated[str, typer.Option(
        "--warmup", help="Leave requests planned in this first stretch out of results.")] = "0",
    timeout: Annotated[str, typer.Option("--timeout", help="Per-request timeout.")] = "60s",
    max_tokens: Annotated[str, typer.Option(
        "--max-tokens", help="Output tokens: 128 or a uniform range 64-256.")] = "128",
    prompt_tokens: Annotated[str, typer.Option(
        "--prompt-tokens",
        help="Synthetic prompt tokens (exact for ftctl sim): 32 or 16-512.")] = "32",
    prompt_file: Annotated[Path | None, typer.Option(
        "--prompt-file", help="JSONL prompts ({\"prompt\"} or {\"messages\"}).")] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="JSONL trace with timestamps to replay (with --rate ignored).")] = None,
    conversations: Annotated[int | None, typer.Option(
        "--conversations", min=1,
        help="Multi-turn: N conversations in turn, each turn's prompt the last turn's "
             "(user message and a synthetic reply of its --max-tokens) plus a new user "
             "message of --prompt-tokens; after --turns turns, N new ones (deterministic "
             "for --seed; chat: messages, else one growing prompt).")] = None,
    turns: Annotated[int, typer.Option(
        "--turns", min=1, help="Multi-turn: requests of each conversation.")] = 4,
    chat: Annotated[bool, typer.Option(
        "--chat", help="Use /v1/chat/completions instead of /v1/completions.")] = False,
    stream: Annotated[bool, typer.Option(
        "--stream/--no-stream", help="Stream tokens (TTFT and ITL per token).")] = False,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Ask the server to ignore EOS (exact output lengths).")] = False,
    min_tokens: Annotated[int | None, typer.Option(
        "--min-tokens", help="Ask for at least this many output tokens.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Model id (default: the worker's, or the target's first).")] = None,
    priority: Annotated[str | None, typer.Option(
        "--priority", help="Priority header for ftctl proxy (x-ftctl-priority).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of arrivals and prompts.")] = 0,
    slo_ttft: Annotated[str | None, typer.Option(
        "--slo-ttft", help="SLO: p99 TTFT, e.g. 500ms.")] = None,
    slo_itl: Annotated[str | None, typer.Option(
        "--slo-itl", help="SLO: p99 inter-token latency, e.g. 50ms.")] = None,
    slo_error_rate: Annotated[float | None, typer.Option(
        "--slo-error-rate", help="SLO: largest error rate, e.g. 0.01.")] = None,
    abort_error_rate: Annotated[float | None, typer.Option(
        "--abort-error-rate",
        help="Abort when the error rate passes this (after 20; under --procs, the "
             "whole run's).")] = None,
    sweep: Annotated[str | None, typer.Option(
        "--sweep", help="Bisect LOW:HIGH requests/s for the highest rate meeting the SLO.")
    ] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write summary.json, requests.csv/.jsonl and load.png into this "
        "directory (made if new; checked before the run; not a symbolic link, and a "
        "link in it is refused, not followed).")] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write load.png with --out.")
    ] = True,
    spin_us: Annotated[int, typer.Option(
        "--spin-us", min=0, max=1_000_000,
        help="Spend this last stretch before each planned send yielding to the event "
             "loop instead of sleeping on a timer: timers wake up to ~1 ms late, the spin "
             "costs CPU (at 200 req/s here: 0 -> lag p99 3 ms, 12% CPU; 1000 -> 0.4 ms, "
             "25%; 5000 -> 0.4 ms, 66%).")] = 1000,
    client: Annotated[str, typer.Option(
        "--client",
        help="HTTP client: http1 (asyncio + httptools, ~3x aiohttp's requests per core; "
             "http:// and https://) or auto (the same).")
    ] = "auto",
    procs: Annotated[int, typer.Option(
        "--procs", min=1, max=1024,
        help="Share the run among this many processes (cores): one planned schedule, "
             "process j sends every N-th arrival; percentiles merged from every sample.")
    ] = 1,
    shard: Annotated[str | None, typer.Option(
        "--shard", help="Run share I of N (0-based, e.g. 0/4) of the run: every N-th "
             "planned arrival (closed loop: an N-th of the users); merge the shares' --out "
             "directories with `ftctl load merge`.")] = None,
    start_at: Annotated[str | None, typer.Option(
        "--start-at", help="Start at this wall-clock time, epoch seconds or ISO 8601 with "
             "a zone (2026-01-01T00:00:00Z), so that shards on several machines begin "
             "together.")] = None,
    metrics_url: Annotated[list[str] | None, typer.Option(
        "--metrics-url", help="Scrape this Prometheus /metrics page (a base URL gets "
             "/metrics) before and after the run and report its counters' change, summed "
             "over labels: migrations, preemptions, errors, requests (Dynamo, vLLM, SGLang, "
             "ftctl proxy). Repeatable. A failed scrape is reported, never fails the run.")
    ] = None,
    json_: JsonFlag = False,
) -> None:
    """Send load and print throughput and latency percentiles.

    Example: ftctl load --url http://127.0.0.1:8000 --rate 20 --duration 60s --max-tokens 128
    --stream --out runs/a

    Exit 0; 1 when the run aborted, missed its SLO or every request failed; 2 bad input
    (checked before the run); 3 when no request could connect.
    """
    if ctx.invoked_subcommand is not None:
        return
    from dynamo_ftctl import loadgen as lg
    from dynamo_ftctl.loadgen.servermetrics import parse_metrics_url

    metrics_urls = [parse_metrics_url(u) for u in metrics_url or ()]
    targets = list(_split(url))
    chosen_model = model
    if workers:
        inv = load_inventory_for(ctx, inventory)
        picked = [inv.worker(name) for name in _split([workers])]
        targets += [w.url for w in picked]
        chosen_model = chosen_model or picked[0].model
    if arrival not in ("poisson", "constant", "gamma"):
        msg = f"--arrival: {arrival!r} is not poisson, constant or gamma"
        raise InvalidInput(msg)
    slo = lg.Slo(
        ttft_p99_ms=None if slo_ttft is None else lg.parse_duration(slo_ttft, what="--slo-ttft")
        * 1000,
        itl_p99_ms=None if slo_itl is None else lg.parse_duration(slo_itl, what="--slo-itl")
        * 1000,
        error_rate=slo_error_rate,
    )
    sweep_bounds = _sweep_bounds(sweep) if sweep else None
    if sweep_bounds and (procs > 1 or shard or start_at):
        msg = "--sweep runs in one process: leave out --procs, --shard and --start-at"
        raise InvalidInput(msg)
    if sweep_bounds and metrics_urls:
        msg = "--metrics-url: not with --sweep (it reports one run's counters)"
        raise InvalidInput(msg)
    if sweep_bounds and rate is None:
        rate = sweep_bounds[0]
    if trace is not None and rate is None and users is None:
        rate = 1.0  # a trace brings its own timestamps; the rate is only a mode switch
    config: LoadConfig = lg.LoadConfig(
        targets=tuple(targets),
        schedule=lg.Schedule(rate=rate, users=users, arrival=arrival,  # type: ignore[arg-type]
                             burstiness=burstiness, ramp_to=ramp_to, ramp_steps=ramp_steps,
                             concurrency=concurrency, seed=seed),
        workload=lg.Workload(
            api="chat" if chat else "completions", model=chosen_model,
            prompt_tokens=lg.parse_length(prompt_tokens, what="--prompt-tokens"),
            max_tokens=lg.parse_length(max_tokens, what="--max-tokens"), stream=stream,
            ignore_eos=ignore_eos, min_tokens=min_tokens, priority=priority,
            prompt_file=prompt_file, trace=trace, conversations=conversations, turns=turns),
        duration_s=None if duration is None else lg.parse_duration(duration, what="--duration"),
        requests=requests,
        warmup_s=lg.parse_duration(warmup, what="--warmup"),
        timeout_s=lg.parse_duration(timeout, what="--timeout"),
        abort_error_rate=abort_error_rate,
        slo=slo,
        spin_s=spin_us / 1e6,
        client=client,  # type: ignore[arg-type]
        shard=None if shard is None else lg.parse_shard(shard),
        start_at=None if start_at is None else lg.parse_start_at(start_at),
    )
    if out is not None:
        lg.report_paths(out, plot=plot)  # a bad --out is refused before the run, not after
    quiet = json_mode(ctx, json_)
    # Several processes: no live line (each share's progress is its own).
    live, on_event = (None, None) if quiet or procs > 1 else _progress_hook(config.requests)
    if sweep_bounds is not None:
        result: Any = lg.sweep_rate(config, low=sweep_bounds[0], high=sweep_bounds[1])
        finish(ctx, result, json_flag=json_, code=0 if result.best_rate_per_s else 1)

    def run() -> Any:
        if procs > 1:
            return lg.run_load_processes(config, procs)
        if live is not None:
            with live:
                return lg.run_load(config, on_event=on_event)
        return lg.run_load(config)

    if metrics_urls:
        from dynamo_ftctl.loadgen.servermetrics import watch_server_metrics

        report = watch_server_metrics(metrics_urls, run)
    else:
        report = run()
    if out is not None:
        lg.write_report(report, out, plot=plot)
    finish(ctx, report, json_flag=json_, code=_exit_code(report))


def _exit_code(report: Any) -> int:
    """3 when no request could connect, 1 when every request failed (an all-404 run
    measured nothing), the run aborted or missed its SLO; else 0."""
    s = report.summary
    if s.completed == 0 and s.failed and set(s.errors_by_class) == {"connect"}:
        return 3
    if s.completed == 0 and s.failed:
        return 1
    return 1 if report.aborted or s.slo_met is False else 0


@app.command()
def compare(
    ctx: typer.Context,
    a: Annotated[Path, typer.Argument(help="Baseline report (summary.json or --json output).")],
    b: Annotated[Path, typer.Argument(help="Report to compare with the baseline.")],
    json_: JsonFlag = False,
) -> None:
    """Print how report B differs from report A, metric by metric.

    Example: ftctl load compare runs/a/summary.json runs/b/summary.json
    """
    from dynamo_ftctl.loadgen import compare_reports

    finish(ctx, compare_reports(a, b), json_flag=json_)


@app.command()
def merge(
    ctx: typer.Context,
    dirs: Annotated[list[Path], typer.Argument(
        help="The --out directories of a run's shards (--shard I/N).")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write the merged summary.json, requests.csv/.jsonl and load.png here.")
    ] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write load.png with --out.")
    ] = True,
    json_: JsonFlag = False,
) -> None:
    """Merge the shards of one run into one report, percentiles exact over every request.

    The shards must be of one run (same setup but --shard) and make it whole, or one
    share of it. Exit codes as a run's.

    Example: ftctl load merge runs/shard-0 runs/shard-1 --out runs/all
    """
    from dynamo_ftctl import loadgen as lg

    if out is not None:
        lg.report_paths(out, plot=plot)
    report = lg.merge_dirs(dirs)
    if out is not None:
        lg.write_report(report, out, plot=plot)
    finish(ctx, report, json_flag=json_, code=_exit_code(report))
