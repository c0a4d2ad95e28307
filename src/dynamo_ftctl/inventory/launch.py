"""A worker's `launch:` recipe: how ftctl itself starts a worker on this host.

`sim` starts an `ftctl sim` engine; `command` any OpenAI-compatible server, with
`{host}`, `{port}` and `{model}` placeholders. Only structs and their checks: the
starting is `engine.launcher`'s and `faults.command_worker`'s.
"""

from __future__ import annotations

import re
from typing import Annotated

from msgspec import field

from dynamo_ftctl.structs import KeyedValueError, StrictStruct, doc

__all__ = ["COMMAND_PLACEHOLDERS", "Launch", "SimLaunch"]


class SimLaunch(StrictStruct, frozen=True):
    """Start this worker as an `ftctl sim` engine with `--local` / `ftctl sim cluster`."""

    seed: Annotated[int, doc("Weight seed: same seed, same model.", ge=0)] = 0
    model_config_name: Annotated[str, doc("Engine config preset or YAML path.")] = field(
        default="ftctl-sim-tiny", name="model_config",
    )
    warmup_s: Annotated[
        float, doc("Extra delay of the first request (`--warmup-s`; default 1.0).", ge=0),
    ] | None = None
    args: Annotated[tuple[str, ...], doc("Extra `ftctl sim serve` flags.")] = ()


_PLACEHOLDER = re.compile(r"(?<!\$)\{([^{}]*)\}")  # `${VAR}` is the environment's
COMMAND_PLACEHOLDERS = ("host", "port", "model")


def _check_placeholders(value: str) -> str:
    for name in _PLACEHOLDER.findall(value):
        if name not in COMMAND_PLACEHOLDERS:
            msg = (f"unknown placeholder {{{name}}} in {value!r} (known: "
                   + ", ".join(f"{{{n}}}" for n in COMMAND_PLACEHOLDERS) + ")")
            raise ValueError(msg)
    return value


class Launch(StrictStruct, frozen=True):
    """Local launch recipe (only for workers started by ftctl itself).

    `sim`: an `ftctl sim` engine. `command`: any OpenAI-compatible server (vLLM…),
    started by `ftctl drill --local` in a process group of its own: `{host}`, `{port}`
    and `{model}` in it become the loopback address and free port the drill picks and
    the worker's `model`; `${VAR}` is taken from the environment when the drill starts
    (an unset one is an error naming the key).
    """

    sim: SimLaunch | None = None
    command: Annotated[
        tuple[str, ...],
        doc("argv of an OpenAI server, with {host}, {port}, {model} and ${VAR}.",
             min_length=1),
    ] | None = None
    env: Annotated[dict[str, str], doc("command: extra environment (values take ${VAR}).")] = (
        field(default_factory=dict)
    )
    health_path: Annotated[str, doc("command: path that answers 200 once it serves.")] = (
        "/health"
    )
    start_timeout_s: Annotated[
        float, doc("command: seconds to wait for health.", gt=0, le=3600),
    ] = 300.0
    warmup: Annotated[
        bool, doc("command: one short completion once healthy (vLLM's first is slow)."),
    ] = True
    _checked = (("command", _check_placeholders),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sim is not None and self.command is not None:
            raise KeyedValueError(("command",), "give sim or command, not both")
        if not self.health_path.startswith("/"):
            raise KeyedValueError(("health_path",), f"must start with '/': {self.health_path!r}")
