"""`ftctl lock`: acquire, inspect and release the failover lock from shell scripts.

Runs in engine entrypoints and probes, so it imports only the flock backend;
the HTTP client loads with `--backend etcd`, PyYAML and msgspec only when the inventory is needed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode, resolve_inventory_path
from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from dynamo_ftctl.inventory.lock import LockConfig
    from dynamo_ftctl.lock.settings import LockSettings

__all__ = [
    "BackendOpt",
    "EndpointOpt",
    "EngineIdOpt",
    "KeyOpt",
    "PathOpt",
    "TtlOpt",
    "app",
    "lock_settings",
]

app = typer.Typer(
    help=(
        "Acquire, inspect and release the failover lock shared by a primary and its shadow.\n\n"
        "flock (one node, default) or etcd (--backend etcd). Exit codes: acquire 0 held "
        "(with a command: the command's status), 4 not acquired within --timeout, 5 lock "
        "lost (etcd lease lost, or --fd's file deleted or replaced); owner/status 0 held, "
        "1 free.\n\n"
        "A flock holder watches its lock file (inotify, and a check every --watch-interval "
        "seconds); once it is deleted or replaced the command gets SIGTERM, SIGKILL "
        "$FTCTL_LOCK_TERM_GRACE (5) s later, and a line on stderr. The stop bound is "
        "interval + grace + 0.5 s: 6 s by default (measured: SIGTERM within milliseconds "
        "of `rm`, SIGKILL 5.03 s after it). An acquirer that locks a file the token floor "
        "has not seen (new, deleted or replaced) waits out that bound before its command "
        "runs, so two commands never overlap: a fresh deployment pays it once. Every "
        "engine sharing a lock must use the same interval and grace.\n\n"
        "Fencing tokens are wall-clock milliseconds x 65536 plus a counter, never below "
        "the last one recorded in PATH.floor: they keep rising across reboots, clock steps "
        "back, and the deletion of the lock file, of the floor, or of both (both deleted "
        "and the clock stepped back by more than the time since the last token is the one "
        "case that can go back). With etcd the token is the key's create revision."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)

PathOpt = Annotated[
    Path | None,
    typer.Option("--path", "-p", help="Lock file (default: $FAILOVER_LOCK_PATH, then "
                 "lock.path in the inventory).", show_default=False),
]
EngineIdOpt = Annotated[
    int | None,
    typer.Option("--engine-id", help="This engine's id (default: $ENGINE_ID, then 0). "
                 "0 may be primary, >= 1 is a shadow.", show_default=False),
]
BackendOpt = Annotated[
    str | None,
    typer.Option("--backend", envvar="FTCTL_LOCK_BACKEND",
                 help="flock (one node) or etcd (across nodes).", show_default="flock"),
]
EndpointOpt = Annotated[
    list[str] | None,
    typer.Option("--endpoint", help="etcd endpoint URL, repeatable (default: lock.etcd in "
                 "the inventory, then http://127.0.0.1:2379).", show_default=False),
]
KeyOpt = Annotated[
    str | None,
    typer.Option("--key", help="etcd key (default: lock.etcd.key, /ftctl/locks/failover).",
                 show_default=False),
]
TtlOpt = Annotated[
    float | None,
    typer.Option("--ttl", help="etcd lease TTL in seconds (default: lock.etcd.ttl_s, 5).",
                 show_default=False),
]
WatchIntervalOpt = Annotated[
    float | None,
    typer.Option("--watch-interval",
                 help="flock: check the lock file every this many seconds while CMD runs "
                 "(inotify tells sooner); deleted or replaced: SIGTERM to CMD, SIGKILL "
                 "$FTCTL_LOCK_TERM_GRACE (5) s later. A new lock file is held interval + "
                 "grace + 0.5 s before CMD runs. 0 turns both off (default: "
                 "$FTCTL_LOCK_WATCH_INTERVAL, then 0.5).", show_default=False),
]
TimeoutOpt = Annotated[
    float | None,
    typer.Option("--timeout", "-t", help="Give up after this many seconds (exit 4); "
                 "0 tries once. Default: wait forever.", show_default=False),
]

_BOTH_FORMS = (
    "lock acquire needs a command or a descriptor: "
    "'ftctl lock acquire --path P -- CMD ARGS...' runs CMD holding the lock (exec, like "
    "flock(1)); 'exec 9<>P; ftctl lock acquire --fd 9' locks the shell's descriptor 9"
)


def lock_settings(
    ctx: typer.Context, *, backend: str | None, engine_id: int | None, path: Path | None,
    endpoints: list[str] | None, key: str | None, ttl_s: float | None,
    watch_interval_s: float | None = None,
) -> LockSettings:
    """Merge flags, environment and the inventory (read only when something is missing)."""
    from dynamo_ftctl.lock.settings import resolve_lock_settings

    def from_inventory() -> LockConfig | None:
        inventory_path = resolve_inventory_path(ctx)
        explicit = inventory_path != Path("ftctl.yaml")
        if not explicit and not inventory_path.exists():
            return None
        from dynamo_ftctl.inventory import load_inventory

        return load_inventory(inventory_path).lock

    return resolve_lock_settings(
        backend=backend, engine_id=engine_id, path=path, endpoints=tuple(endpoints or ()),
        key=key, ttl_s=ttl_s, watch_interval_s=watch_interval_s, inventory=from_inventory,
    )


@app.command(context_settings={"allow_interspersed_args": False})
def acquire(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    command: Annotated[list[str] | None, typer.Argument(
        help="Command to run holding the lock (after --).", show_default=False)] = None,
    path: PathOpt = None,
    fd: Annotated[int | None, typer.Option(
        "--fd", help="Lock this already open descriptor instead of running a command "
        "(ftctl then exits: nothing watches the lock file; exit 5 if it was already deleted "
        "or replaced).",
        show_default=False)] = None,
    engine_id: EngineIdOpt = None,
    timeout: TimeoutOpt = None,
    watch_interval: WatchIntervalOpt = None,
    backend: BackendOpt = None,
    endpoint: EndpointOpt = None,
    key: KeyOpt = None,
    ttl: TtlOpt = None,
    json_: JsonFlag = False,
) -> None:
    """Acquire the lock, then exec CMD with the locked descriptor inherited (or lock --fd N).

    Examples:
      ftctl lock acquire --path /shared/failover.lock --engine-id 0 -- vllm serve m
      exec 9<>/shared/failover.lock; ftctl lock acquire --fd 9 --timeout 30
    """
    if fd is not None and command:
        msg = "give either --fd N or a command, not both"
        raise InvalidInput(msg)
    if fd is None and not command:
        raise InvalidInput(_BOTH_FORMS)
    if fd is not None:
        if (backend or "flock") != "flock":
            msg = "--fd works with the flock backend only"
            raise InvalidInput(msg)
        if watch_interval is not None:  # ($FTCTL_LOCK_WATCH_INTERVAL, pod-wide, is ignored)
            msg = ("--watch-interval needs the command form (-- CMD): with --fd nothing "
                   "stays behind to watch the lock file")
            raise InvalidInput(msg)
        from dynamo_ftctl.lock.flock import flock_descriptor
        from dynamo_ftctl.lock.settings import engine_id_from_env
        from dynamo_ftctl.output import emit  # before the wait, not after the grant

        lease = flock_descriptor(fd, engine_id_from_env(engine_id), timeout=timeout)
        emit(lease, json_mode=json_mode(ctx, json_))
        raise typer.Exit(0)
    assert command is not None
    settings = lock_settings(ctx, backend=backend, engine_id=engine_id, path=path,
                             endpoints=endpoint, key=key, ttl_s=ttl,
                             watch_interval_s=watch_interval)
    from dynamo_ftctl.lock.holder import hold_for_command

    raise typer.Exit(hold_for_command(settings, command, timeout))


def _status(
    ctx: typer.Context, *, path: Path | None, backend: str | None, endpoint: list[str] | None,
    key: str | None, json_: bool,
) -> None:
    settings = lock_settings(ctx, backend=backend, engine_id=None, path=path,
                             endpoints=endpoint, key=key, ttl_s=None)
    from dynamo_ftctl.lock.settings import open_lock

    status = open_lock(settings).status()
    code = 0 if status.held else 1
    if json_mode(ctx, json_):
        finish(ctx, status, json_flag=True, code=code)
    owner = status.owner
    if owner is None:
        sys.stdout.write(f"{status.lock}: free (never held)\n")
    else:
        state = "held" if status.held else "free (stale owner data, holder is gone)"
        sys.stdout.write(
            f"{status.lock}: {state}: engine {owner.engine_id}, pid {owner.pid}, "
            f"host {owner.host}, token {owner.token}\n",
        )
    raise typer.Exit(code)


@app.command()
def owner(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context, path: PathOpt = None, backend: BackendOpt = None,
    endpoint: EndpointOpt = None, key: KeyOpt = None, json_: JsonFlag = False,
) -> None:
    """Show who holds the lock: exit 0 held, 1 free (stale data of a dead holder is shown).

    Example: ftctl lock owner --path /shared/failover.lock --json
    """
    _status(ctx, path=path, backend=backend, endpoint=endpoint, key=key, json_=json_)


@app.command()
def status(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context, path: PathOpt = None, backend: BackendOpt = None,
    endpoint: EndpointOpt = None, key: KeyOpt = None, json_: JsonFlag = False,
) -> None:
    """Exit 0 when the lock is held, 1 when free (for probes); same output as `owner`.

    Example: ftctl lock status --path /shared/failover.lock
    """
    _status(ctx, path=path, backend=backend, endpoint=endpoint, key=key, json_=json_)


@app.command()
def release(
    fd: Annotated[int, typer.Option("--fd", help="Descriptor locked by `acquire --fd`.")],
) -> None:
    """Release a lock taken with `ftctl lock acquire --fd N`.

    Example: ftctl lock release --fd 9
    """
    from dynamo_ftctl.lock.flock import unlock_descriptor

    unlock_descriptor(fd)
