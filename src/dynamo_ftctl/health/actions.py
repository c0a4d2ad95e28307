"""Transition actions: what the daemon does when a worker changes state.

An action from the inventory (`canary.actions`) is an HTTP POST (for example a
drain endpoint) carrying the transition as JSON, or a command run with
`FTCTL_WORKER`, `FTCTL_STATE`, `FTCTL_PREVIOUS_STATE` and `FTCTL_REASON` in its
environment. Each is bounded by its `timeout_s`; a command past it is killed.
An action never raises: its outcome is returned (and logged as a JSON line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.process import run_async

if TYPE_CHECKING:
    from dynamo_ftctl.health.state import Transition
    from dynamo_ftctl.http1 import Client
    from dynamo_ftctl.inventory.canary import TransitionAction

__all__ = ["ActionOutcome", "actions_for", "run_action"]


@dataclass(frozen=True)
class ActionOutcome:
    """What one action did."""

    worker: str
    state: str
    action: str
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"event": "action", "worker": self.worker, "state": self.state,
                "action": self.action, "ok": self.ok, "detail": self.detail}


def actions_for(
    actions: tuple[TransitionAction, ...], transition: Transition,
) -> list[TransitionAction]:
    """The actions whose `on` names the state just entered."""
    return [a for a in actions if transition.state.value in a.on]


def _describe(action: TransitionAction) -> str:
    if action.http is not None:
        return f"POST {action.http}"
    return " ".join(action.command or ())


async def run_action(
    action: TransitionAction, transition: Transition, *, session: Client,
) -> ActionOutcome:
    """Run one action for one transition; never raises.

    `session`: the daemon transport's `http1.Client` (its `session`), for HTTP actions.
    """
    name = _describe(action)

    def outcome(ok: bool, detail: str) -> ActionOutcome:
        return ActionOutcome(transition.worker, transition.state.value, name, ok, detail)

    try:
        if action.http is not None:
            return outcome(*await _post(action, transition, session))
        return outcome(*await _command(action, transition))
    except Exception as exc:  # an action must not take the daemon down
        return outcome(False, f"{exc.__class__.__name__}: {exc}")


async def _post(action: TransitionAction, transition: Transition,
                session: Client) -> tuple[bool, str]:
    headers = {"Content-Type": "application/json"}
    if action.token_env:
        token = os.environ.get(action.token_env)
        if not token:
            return False, f"${action.token_env} is not set"
        headers["Authorization"] = f"Bearer {token}"
    assert action.http is not None
    from dynamo_ftctl.http1 import HttpError  # the daemon's: a one-shot probe never acts

    body = json.dumps(transition.to_json()).encode()
    try:
        status, _ = await session.fetch("POST", action.http, body, headers,
                                        timeout_s=action.timeout_s)
    except TimeoutError:
        return False, f"no answer within {action.timeout_s:g} s"
    except HttpError as exc:
        return False, f"{exc.__class__.__name__}: {exc}"
    return 200 <= status < 300, f"HTTP {status}"


async def _command(action: TransitionAction, transition: Transition) -> tuple[bool, str]:
    argv = list(action.command or ())
    env = {**os.environ, "FTCTL_WORKER": transition.worker, "FTCTL_STATE": transition.state.value,
           "FTCTL_PREVIOUS_STATE": transition.previous.value, "FTCTL_REASON": transition.reason}
    try:
        done = await run_async(argv, env=env, timeout_s=action.timeout_s)
    except OSError as exc:
        return False, f"cannot run {argv[0]!r}: {exc.strerror or exc}"
    if done.timed_out:
        return False, f"killed after {action.timeout_s:g} s"
    if done.returncode == 0:
        return True, "exit 0"
    last = done.stderr.strip().splitlines()[-1:] or [""]
    return False, f"exit {done.returncode}: {last[0][:200]}"
