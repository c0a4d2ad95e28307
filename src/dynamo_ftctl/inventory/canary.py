"""The `canary:` section: probing, the health state machine and the daemon's actions."""

from __future__ import annotations

from typing import Annotated, Literal

from dynamo_ftctl.structs import KeyedValueError, StrictStruct, check_host_port, check_http_url, doc

__all__ = ["CanaryConfig", "HealthStateName", "TransitionAction"]


HealthStateName = Literal["healthy", "suspicious", "unhealthy", "draining", "dead"]


class TransitionAction(StrictStruct, frozen=True):
    """What the canary daemon does when a worker enters one of `on` (HTTP call or command)."""

    on: Annotated[
        tuple[HealthStateName, ...], doc("States whose entry triggers the action.", min_length=1),
    ] = ("unhealthy",)
    http: Annotated[
        str | None, doc("POST {worker, state, previous, reason} as JSON to this URL."),
    ] = None
    token_env: Annotated[str | None, doc("Variable holding a bearer token for the HTTP call.")] = (
        None
    )
    command: Annotated[
        tuple[str, ...],
        doc("argv to run with FTCTL_WORKER, FTCTL_STATE, FTCTL_PREVIOUS_STATE set.", min_length=1),
    ] | None = None
    timeout_s: Annotated[float, doc("Give up on the action after this long.", gt=0)] = 10.0
    _checked = (("http", check_http_url),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.http is None) == (self.command is None):
            raise KeyedValueError(("http",), "give exactly one of 'http' or 'command'")


class CanaryConfig(StrictStruct, frozen=True):
    """Canary probing and the health state machine."""

    interval_s: Annotated[float, doc("Seconds between probes of a worker.", gt=0)] = 30.0
    timeout_s: Annotated[float, doc("Per-request timeout.", gt=0)] = 10.0
    max_retries: Annotated[int, doc("Retries on transient errors only.", ge=0, le=10)] = 2
    set: Annotated[str | None, doc("Canary set YAML, relative to the inventory.")] = None
    latency_spike_factor: Annotated[
        float, doc("A probe slower than this times the EMA baseline is a latency spike.", gt=1.0),
    ] = 3.0
    ema_alpha: Annotated[
        float, doc("Weight of the newest latency in the EMA baseline.", gt=0.0, le=1.0),
    ] = 0.1
    failure_threshold: Annotated[
        int, doc("Consecutive failures that make a worker UNHEALTHY.", ge=1, le=100),
    ] = 3
    recovery_s: Annotated[
        float, doc("Seconds an open breaker waits before one half-open trial.", gt=0),
    ] = 60.0
    dead_after_trials: Annotated[
        int,
        doc("Failed half-open trials before DEAD (the first one moves to DRAINING).", ge=1,
             le=100),
    ] = 2
    parallel_prompts: Annotated[
        bool,
        doc("Send a set's prompts at once: a probe's latency is its slowest answer (false: "
             "one after another, its latency is their sum)."),
    ] = True
    concurrency: Annotated[
        int, doc("Probes in flight at once in the daemon.", ge=1, le=10000),
    ] = 256
    listen: Annotated[str, doc("Daemon HTTP address (/workers, /report, /metrics).")] = (
        "127.0.0.1:8090"
    )
    token_env: Annotated[
        str,
        doc("Variable holding the bearer token of POST /report (unset: reports refused, "
             "403); `ftctl gpu --report` sends it too.", min_length=1),
    ] = "FTCTL_DAEMON_TOKEN"  # noqa: S105 - the variable's name, not a secret
    report_rate_per_s: Annotated[
        float, doc("Reports a second one client address may send (beyond: 429).", gt=0),
    ] = 10.0
    report_burst: Annotated[
        int, doc("Reports one client address may send at once.", ge=1, le=10000),
    ] = 20
    state_file: Annotated[
        str | None, doc("Latency baseline file (default: $XDG_STATE_HOME/ftctl/canary.json)."),
    ] = None
    transition_log: Annotated[
        str | None, doc("Append every state transition here as a JSON line."),
    ] = None
    actions: Annotated[
        tuple[TransitionAction, ...], doc("HTTP calls or commands run on state transitions."),
    ] = ()
    acting_lock: Annotated[
        str | None,
        doc("Lock file on a volume several daemons share: only its holder runs the actions, "
             "the others probe and serve /workers and take over when it dies (unset: this "
             "daemon acts alone)."),
    ] = None
    _checked = (("listen", check_host_port),)
