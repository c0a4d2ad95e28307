"""The `ftctl` console script: answers what it can before loading the CLI framework.

Probes and entrypoint scripts call `ftctl --version` to check the binary, and
Kubernetes exec probes run `ftctl canary --worker w3` every few seconds; neither
should pay for importing typer and click (about 40 ms). A one-shot canary probe
in its plain spelling runs without them (`cli/probe.py`); everything else, and
anything the fast path is unsure of, goes to the full CLI. So does a plain
`ftctl lock acquire` (`cli/lock_fast.py`): its handoff must cost what flock(1)'s does.

The console script (`console`) also trims what a short-lived probe process pays
around its work, about a third of its wall time on a 2-core VM:

- no cyclic garbage collection while it runs: the collector would walk the
  ~15,000 objects of the imported modules several times, and a probe creates
  no cycles worth reclaiming before it exits;
- msgspec is imported without `typing_extensions`, which it only tries (falling
  back to `typing`'s own `get_type_hints`, `Required` and `NotRequired`) and
  which imports `inspect`: about 15 ms. Our structs use `typing` alone;
- no interpreter teardown after the probe: `atexit` handlers run and stdio is
  flushed, then the process ends (module teardown and its full collections
  cost about 20 ms, more than the probe's own requests). `ftctl lock acquire`
  ends the same way: after `--fd N` the shell's next command waits for it.

`main(argv)` is the same dispatch for callers in a process that lives on (tests,
scripts): it returns the exit code and changes nothing global.
"""

from __future__ import annotations

import sys

__all__ = ["console", "main"]


def _fast(args: list[str]) -> int | None:
    """The exit code of a command answered without the CLI framework, else None."""
    if args == ["--version"]:
        from dynamo_ftctl import __version__

        sys.stdout.write(f"ftctl {__version__}\n")
        return 0
    if args[:2] == ["lock", "acquire"]:
        from dynamo_ftctl.cli.lock_fast import fast_lock_acquire

        return fast_lock_acquire(args)
    if "canary" in args:
        from dynamo_ftctl.cli.probe import fast_canary

        return fast_canary(args)
    return None


def _full(args: list[str]) -> int:
    """The exit code of `args` run by the full CLI (typer and click)."""
    from dynamo_ftctl.cli.main import main as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """Run `ftctl` with `argv` (default: `sys.argv[1:]`); its exit code."""
    args = sys.argv[1:] if argv is None else argv
    rc = _fast(args)
    return rc if rc is not None else _full(args)


def console() -> int:
    """The `ftctl` console script (and `python -m dynamo_ftctl`): `main`, with a lean
    start and end for the one-shot probe."""
    args = sys.argv[1:]
    if args[:2] == ["lock", "acquire"]:
        # `acquire --fd N` holds the lock when this process ends: the shell's next
        # command waits for its exit, so skip the teardown (~10-100 ms with the CLI
        # framework loaded). The command form never gets here: it execs or fails.
        _quick_exit(main(args))
    if "canary" not in args:
        return main(args)
    import gc

    gc.disable()
    _import_msgspec_lean()
    rc = _fast(args)
    if rc is not None:
        _quick_exit(rc)
    gc.enable()
    return _full(args)


def _import_msgspec_lean() -> None:
    """Import msgspec with `typing_extensions` hidden (it falls back to `typing`)."""
    if "msgspec" in sys.modules or "typing_extensions" in sys.modules:
        return
    sys.modules["typing_extensions"] = None  # type: ignore[assignment]  # makes import raise
    try:
        import msgspec  # noqa: F401
    finally:
        del sys.modules["typing_extensions"]


def _quick_exit(code: int) -> None:
    """End the process now: `atexit` handlers and stdio flushes, no interpreter teardown."""
    import atexit
    import contextlib
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe
            stream.flush()
    os._exit(code)
