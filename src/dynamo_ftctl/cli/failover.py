"""`ftctl failover run`: run an engine as a primary or shadow behind the failover lock."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, json_mode
from dynamo_ftctl.cli.lock import (
    BackendOpt,
    EndpointOpt,
    EngineIdOpt,
    KeyOpt,
    PathOpt,
    TtlOpt,
    lock_settings,
)

if TYPE_CHECKING:
    from dynamo_ftctl.lock.failover import StateChange

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Run an engine as a primary or shadow: start it, wait for /health, put it to sleep "
        "(STANDBY), wait for the failover lock, wake it (WAKING) and serve (ACTIVE). "
        "A cold standby (--standby cold, or auto when the engine has no sleep mode) starts "
        "the engine only once it holds the lock.\n\n"
        "Exit codes: 0 stopped by SIGTERM, 1 engine died or did not wake in time, "
        "2 bad usage (or --standby sleep and the engine refuses /sleep), 3 engine never "
        "healthy, 5 lock lost (lock file deleted or replaced, etcd lease lost: the engine "
        "is stopped), 130 interrupted."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)


@app.callback()
def failover() -> None:
    """Run engines as primary/shadow behind the failover lock (see `failover run`)."""


@app.command(context_settings={"allow_interspersed_args": False})
def run(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    command: Annotated[list[str], typer.Argument(help="Engine command (after --).")],
    engine_id: EngineIdOpt = None,
    health_port: Annotated[int, typer.Option(
        "--health-port", help="Port of this wrapper's health endpoint (503 INIT, 200 "
        "STANDBY/WAKING/ACTIVE, JSON state; /metrics).")] = 8081,
    health_host: Annotated[str, typer.Option(
        "--health-host", help="Address the health endpoint binds.")] = "127.0.0.1",
    engine_url: Annotated[str, typer.Option(
        "--engine-url", help="Base URL of the engine's HTTP server.")] = "http://127.0.0.1:8000",
    wake_timeout: Annotated[float, typer.Option(
        "--wake-timeout", help="Seconds the engine may take to wake (exit 1 after).")] = 30.0,
    ready_timeout: Annotated[float, typer.Option(
        "--ready-timeout", help="Seconds the engine may take to become healthy (exit 3 after)."),
    ] = 600.0,
    sleep_level: Annotated[int, typer.Option(
        "--sleep-level", help="vLLM sleep level (1: offload weights, 2: discard).")] = 1,
    standby: Annotated[str, typer.Option(
        "--standby", help="How the shadow waits: sleep (engine asleep; exit 2 if it refuses "
        "/sleep), cold (engine started only with the lock), auto (sleep, else cold).",
    )] = "auto",
    admin_token_env: Annotated[str, typer.Option(
        "--admin-token-env", help="Variable holding the engine's admin token, sent as "
        "Authorization: Bearer on /sleep and /wake_up (ftctl sim requires it); unset: a "
        "random token, given to the engine in that variable.")] = (
        "FTCTL_ADMIN_TOKEN"),  # noqa: S107 - a variable's name, not a secret
    backend: BackendOpt = None,  # the lock: which backend, then where
    path: PathOpt = None,
    endpoint: EndpointOpt = None,
    key: KeyOpt = None,
    ttl: TtlOpt = None,
    json_: JsonFlag = False,
) -> None:
    """Start CMD, sleep it, block on the lock, wake it; state lines on stderr (--json: stdout).

    Example: ftctl failover run --engine-id 1 --health-port 8081 --path /shared/failover.lock
    --engine-url http://127.0.0.1:8000 -- vllm serve m --enable-sleep-mode --port 8000
    """
    from dynamo_ftctl.lock.failover import FailoverConfig, run_failover
    from dynamo_ftctl.lock.settings import open_lock
    from dynamo_ftctl.output import emit_line

    settings = lock_settings(ctx, backend=backend, engine_id=engine_id, path=path,
                             endpoints=endpoint, key=key, ttl_s=ttl)
    as_json = json_mode(ctx, json_)

    def report(change: StateChange) -> None:
        if as_json:
            emit_line(change)
            return
        token = f" token {change.token}" if change.token is not None else ""
        sys.stderr.write(f"failover: engine {change.engine_id} {change.state}{token}: "
                         f"{change.detail} (health port {change.health_port})\n")
        sys.stderr.flush()

    config = FailoverConfig(
        argv=tuple(command), engine_id=settings.engine_id, engine_url=engine_url.rstrip("/"),
        health_host=health_host, health_port=health_port, ready_timeout_s=ready_timeout,
        wake_timeout_s=wake_timeout, sleep_level=sleep_level, standby=standby,
        admin_token_env=admin_token_env,
    )
    raise typer.Exit(run_failover(config, open_lock(settings, metrics=True), on_state=report))
