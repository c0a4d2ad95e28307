"""`ftctl drill scenario.yaml`: run a chaos drill and report whether the cluster held."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Run a chaos drill: hypothesis before, method (load + timeline of faults), "
        "rollbacks (always), hypothesis after. Exit 0 when the hypothesis holds before "
        "and after, 1 when it does not, 2 for an invalid scenario.\n\n"
        "Example: ftctl drill drills/worker-crash.yaml --local"
    ),
    rich_markup_mode=None,
)


@app.command()
def drill(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML (see drills/).")],
    local: Annotated[bool, typer.Option(
        "--local", help="Start the scenario's workers (launch.sim: ftctl sim; launch.command: "
        "any OpenAI server, e.g. vLLM; none: used as running), fault proxies and the "
        "migrating proxy on loopback first; stop what it started after.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Report folder (default: reports/drills/<scenario>-<time>); not a "
        "symbolic link, and a link in it is refused, not followed.")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Skip timeline.png.")] = False,
    json_: JsonFlag = False,
) -> None:
    """Run one drill scenario; writes report.json, report.md and timeline.png."""
    from dynamo_ftctl.drill import run_drill
    from dynamo_ftctl.output import progress

    # Each step of the drill is a log line (on stderr, piped too: a log of what was done);
    # on a terminal the live line below them shows the latest and the time so far.
    with progress(f"drill {scenario.name}: starting", counted=False,
                  quiet=json_mode(ctx, json_)) as status:

        def log(line: str) -> None:
            status.print(f"drill: {line}")
            status.note(f"drill {scenario.name}: {line}")

        report = run_drill(scenario, local=local, out_dir=out, log=log, plot=not no_plot)
    finish(ctx, report, json_flag=json_, code=0 if report.passed else 1)
