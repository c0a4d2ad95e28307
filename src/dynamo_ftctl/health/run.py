"""What `ftctl canary` does, as library calls: one-shot probes, recording, the daemon.

Each function turns the CLI's choices (inventory or not, `--worker`/`--all`/
`--url`, `--set`, state file) into the calls of `probe`, `record` and
`daemon`, so the CLI stays a parser and a renderer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_ftctl import structs
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.health.baseline import BaselineStore
from dynamo_ftctl.health.canaryset import CanarySet, ensure_loaded
from dynamo_ftctl.health.probe import ProbeReport, ProbeTarget, probe_workers

if TYPE_CHECKING:
    from dynamo_ftctl.health.actions import ActionOutcome
    from dynamo_ftctl.health.daemon import DaemonSummary
    from dynamo_ftctl.health.state import Transition
    from dynamo_ftctl.inventory import Inventory
    from dynamo_ftctl.inventory.canary import CanaryConfig

__all__ = ["RecordResult", "canary_config", "record_set", "resolve_set", "run_canary",
           "watch_fleet"]


def canary_config(inventory: Inventory | None, *, timeout_s: float | None = None,
                  max_retries: int | None = None) -> CanaryConfig:
    """The inventory's `canary:` settings (defaults without one), with flag overrides."""
    from dynamo_ftctl.inventory.canary import CanaryConfig

    config = inventory.canary if inventory is not None else CanaryConfig()
    update: dict[str, Any] = {}
    if timeout_s is not None:
        update["timeout_s"] = timeout_s
    if max_retries is not None:
        update["max_retries"] = max_retries
    return structs.replace(config, **update) if update else config


def resolve_set(inventory: Inventory | None, explicit: Path | None) -> tuple[Path, CanarySet]:
    """`--set FILE`, else the inventory's `canary.set` (relative to the inventory file)."""
    if explicit is not None:
        path = explicit
    elif inventory is not None and inventory.canary.set:
        path = inventory.resolve(inventory.canary.set)
    else:
        msg = "no canary set: pass --set FILE or set canary.set in the inventory"
        raise InvalidInput(msg)
    return path, ensure_loaded(path)


def _targets(
    inventory: Inventory | None, workers: Sequence[str], all_workers: bool, url: str | None,
) -> list[ProbeTarget]:
    chosen = sum((bool(workers), all_workers, url is not None))
    if chosen != 1:
        msg = "name the target: --worker NAME (repeatable), --all, or --url URL"
        raise InvalidInput(msg)
    if url is not None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            msg = f"--url: not a valid http(s) URL: {url!r}"
            raise InvalidInput(msg)
        clean = url.rstrip("/")
        return [ProbeTarget(clean, clean)]
    if inventory is None:
        msg = "--worker and --all need an inventory (-i FILE or $FTCTL_INVENTORY)"
        raise InvalidInput(msg)
    chosen_workers = inventory.workers if all_workers else [inventory.worker(n) for n in workers]
    return [ProbeTarget(w.name, w.url, w.model) for w in chosen_workers]


def _store(inventory: Inventory | None, state_file: Path | None, use_state: bool,
           ) -> BaselineStore | None:
    if not use_state:
        return None
    if state_file is not None:
        return BaselineStore(state_file)
    if inventory is not None and inventory.canary.state_file:
        return BaselineStore(inventory.resolve(inventory.canary.state_file))
    return BaselineStore()


def run_canary(
    inventory: Inventory | None, *, workers: Sequence[str] = (), all_workers: bool = False,
    url: str | None = None, set_path: Path | None = None, state_file: Path | None = None,
    use_state: bool = True, timeout_s: float | None = None,
) -> ProbeReport:
    """`ftctl canary --worker/--all/--url`: probe once and judge."""
    targets = _targets(inventory, workers, all_workers, url)
    path, canary_set = resolve_set(inventory, set_path)
    config = canary_config(inventory, timeout_s=timeout_s)
    store = _store(inventory, state_file, use_state)
    return probe_workers(targets, canary_set, config, store=store, set_name=str(path))


class RecordResult(msgspec.Struct, frozen=True):
    """What `ftctl canary record` wrote."""

    file: Path
    model: str
    recorded_from: str
    prompts: int
    repeats: int
    set: CanarySet

    def to_json(self) -> dict[str, Any]:
        return {"file": str(self.file), "kind": self.set.kind, "note": self.set.note,
                "model": self.model, "recorded_from": self.recorded_from,
                "prompts": self.prompts, "repeats": self.repeats,
                "set": structs.to_data(self.set, exclude_none=True)}

    def __rich__(self) -> str:
        if self.set.kind == "shape":
            return (f"recorded the shape of {self.prompts} prompts for {self.model} from "
                    f"{self.recorded_from} ({self.repeats} samples each; {self.set.note}) "
                    f"-> {self.file}")
        return (f"recorded {self.prompts} prompts for {self.model} from {self.recorded_from} "
                f"({self.repeats} identical runs each) -> {self.file}")


def record_set(
    inventory: Inventory | None, *, worker: str | None = None, url: str | None = None,
    model: str | None = None, out: Path | None = None, repeats: int | None = None,
    max_tokens: int = 8, prompts: Sequence[tuple[str, str]] | None = None,
    timeout_s: float | None = None, warmup_timeout_s: float | None = None,
    on_warmup: Callable[[float], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None, shape: bool = False,
    latency_tolerance: float | None = None,
) -> RecordResult:
    """`ftctl canary record`: capture a golden set (or with `shape`, a shape set) from a
    good worker and write it.

    A warm-up request with its own deadline comes first (`record_canary_set`);
    `on_progress(done, total)` follows the recording requests. `repeats`: runs per
    prompt (default 3, all must agree), or with `shape` the samples measured (default 5).
    """
    from dynamo_ftctl.health.canaryset import DEFAULT_LATENCY_TOLERANCE, dump_canary_set
    from dynamo_ftctl.health.record import (
        DEFAULT_PROMPTS,
        DEFAULT_SAMPLES,
        DEFAULT_WARMUP_TIMEOUT_S,
        record_canary_set,
        record_shape_set,
    )
    from dynamo_ftctl.safefiles import check_output_path, file_name_for

    targets = _targets(inventory, [worker] if worker else [], False, url)
    target = targets[0]
    served = model or target.model
    if served is None:
        msg = "--url needs --model (the served model id to record for)"
        raise InvalidInput(msg)
    if repeats is None:
        repeats = DEFAULT_SAMPLES if shape else 3
    if repeats < 2:
        msg = ("--repeats must be at least 2 (a shape is measured over several answers)"
               if shape else "--repeats must be at least 2 (a golden answer must repeat)")
        raise InvalidInput(msg)
    if latency_tolerance is not None and not shape:
        msg = "--latency-tolerance is for shape sets: add --shape"
        raise InvalidInput(msg)
    # A model id is data: `Qwen/Qwen2.5` becomes canaries/Qwen--Qwen2.5.yaml, one name
    # that stays in canaries/ whatever the id holds ('..', '/').
    path = out or Path("canaries") / file_name_for(served, ".yaml")
    check_output_path(path)  # a bad --out is refused before the worker is asked anything
    config = canary_config(inventory, timeout_s=timeout_s)
    warmup = DEFAULT_WARMUP_TIMEOUT_S if warmup_timeout_s is None else warmup_timeout_s
    if shape:
        recorded = record_shape_set(
            target, model=served, prompts=prompts or DEFAULT_PROMPTS, max_tokens=max_tokens,
            samples=repeats, timeout_s=config.timeout_s, warmup_timeout_s=warmup,
            latency_tolerance=latency_tolerance or DEFAULT_LATENCY_TOLERANCE,
            on_warmup=on_warmup, on_progress=on_progress)
    else:
        recorded = record_canary_set(
            target, model=served, prompts=prompts or DEFAULT_PROMPTS, max_tokens=max_tokens,
            repeats=repeats, timeout_s=config.timeout_s, warmup_timeout_s=warmup,
            on_warmup=on_warmup, on_progress=on_progress)
    dump_canary_set(recorded, path)
    return RecordResult(path, served, recorded.recorded_from or target.url,
                        len(recorded.prompts), repeats, recorded)


def watch_fleet(
    inventory: Inventory, *, set_path: Path | None = None, listen: str | None = None,
    state_file: Path | None = None, use_state: bool = True,
    on_transition: Callable[[Transition], None] | None = None,
    on_action: Callable[[ActionOutcome], None] | None = None,
    on_ready: Callable[[str], None] | None = None, live: bool = False,
    acting_lock: Path | None = None,
) -> DaemonSummary:
    """`ftctl canary --watch`: run the health daemon over every inventory worker."""
    from dynamo_ftctl.health.daemon import run_daemon

    _, canary_set = resolve_set(inventory, set_path)
    for worker in inventory.workers:
        if worker.model != canary_set.model:
            msg = (f"worker {worker.name!r} serves {worker.model!r} but the canary set is for "
                   f"{canary_set.model!r}")
            raise InvalidInput(msg)
    for source in inventory.discovery:
        if source.model != canary_set.model:
            msg = (f"discovery {source.name!r} serves {source.model!r} but the canary set is "
                   f"for {canary_set.model!r}")
            raise InvalidInput(msg)
    return run_daemon(inventory, canary_set, inventory.canary, listen=listen,
                      store=_store(inventory, state_file, use_state),
                      on_transition=on_transition, on_action=on_action, on_ready=on_ready,
                      live=live, acting_lock=acting_lock)
