"""The one error boundary of ftctl: every failure a user can meet is an `FtctlError`.

Low-level exceptions (OSError, http1, yaml, torch) are translated into these
where they enter the library; the CLI turns them into one red line on stderr
and the exit code the class carries. A name after the class is the module that
defines it (it subclasses one defined here); the others are defined here.

    FtctlError (1)
    ├── CheckFailed (1)            a probe ran and the target is unhealthy
    ├── WriteFailed (1)            an output file could not be written (names the path)
    ├── ApiError (1)               openai: an OpenAI error body or SSE error event
    ├── ShareFailed (1)            loadgen.processes: a process of `load --procs N` failed
    │                              (exit 2 when that process failed on bad input)
    ├── ChildCrashed (1)           proxy.errors:  a child of `proxy --procs N` died at start
    ├── InvalidInput (2)           bad flags, inventory, scenario, canary set
    │   ├── InventoryError (2)     carries file, line and key path
    │   ├── MissingExtra (2)       the command needs an optional extra: names what to install
    │   ├── OutputRefused (2)      an output path names a device, FIFO, socket, directory
    │   │                          or a symbolic link out of its directory
    │   ├── KVChecksumError (2)    kv.export: an imported block does not match its checksum
    │   ├── KvApiMissing (2)       migrate.transfer: a worker has no admin KV route
    │   ├── ParamError (2)         engine.errors: a request field the sim refuses (its 400)
    │   └── UnencodableText (2)    engine.errors: text the sim's tokenizer has no ids for
    ├── Unreachable (3)            target refused, timed out or is missing
    ├── LockTimeout (4)            lock not acquired within --timeout
    ├── LeaseLost (5)              a held lock was lost: lease expired, lock file replaced
    └── Interrupted (130)          Ctrl-C / SIGINT

An exception that never leaves its package (http1's `HttpError` tree, health's
`TransportError`, the sim's `StreamFailed`) is no `FtctlError`: each package keeps
its exceptions in one module and translates them where they leave it. No two
exception classes of ftctl share a name. tests/unit/foundation/test_error_tree.py
holds the code to this tree.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

__all__ = [
    "EXTRA_OF_MODULE",
    "CheckFailed",
    "ExitCode",
    "FtctlError",
    "Interrupted",
    "InvalidInput",
    "InventoryError",
    "LeaseLost",
    "LockTimeout",
    "MissingExtra",
    "OutputRefused",
    "Unreachable",
    "WriteFailed",
    "require_extra",
]


class ExitCode(IntEnum):
    """Exit codes shared by every command (README, man pages, tests)."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    LOCK_TIMEOUT = 4
    LEASE_LOST = 5
    INTERRUPTED = 130


class FtctlError(Exception):
    """Base of every ftctl error; `exit_code` is what the CLI exits with."""

    exit_code: ExitCode = ExitCode.FAILED


class CheckFailed(FtctlError):
    """A check ran to completion and its verdict is negative."""

    exit_code = ExitCode.FAILED


class WriteFailed(FtctlError):
    """The system refused a write (permission, full or read-only disk); names the path.

    Exit 1, as a full disk under a redirected stdout: the input was fine.
    """

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class InvalidInput(FtctlError):
    """Bad usage or invalid input: flags, inventory, scenario or canary files."""

    exit_code = ExitCode.USAGE


class InventoryError(InvalidInput):
    """An invalid YAML document; the message names file, line and key path."""

    def __init__(
        self, message: str, *, path: Path | str | None = None, line: int | None = None,
        key: str | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.line = line
        self.key = key
        self.reason = message
        where = ""
        if self.path is not None:
            where = f"{self.path}:{line}: " if line is not None else f"{self.path}: "
        if key:
            where += f"{key}: "
        super().__init__(f"{where}{message}")


# The optional extras (pyproject.toml) by the top-level module that needs them. The base
# install runs every command that needs neither torch nor a GPU.
EXTRA_OF_MODULE: dict[str, str] = {
    "torch": "sim",
    "tokenizers": "sim",
    "numpy": "sim",
    "pynvml": "gpu",
    "matplotlib": "plot",
    "vllm": "vllm",
}


class MissingExtra(InvalidInput):
    """A command needs a module of an optional extra that is not installed (exit 2):
    one line saying which extra to install, rather than a traceback."""

    def __init__(self, module: str, extra: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(
            f"this command needs {module}, from the {extra} extra: "
            f"pip install 'dynamo-ftctl[{extra}]'")

    @classmethod
    def from_import_error(cls, exc: ImportError) -> MissingExtra | None:
        """The `MissingExtra` for a failed import of an extra's module, else None
        (a missing base module is a broken install: its traceback stays)."""
        if not isinstance(exc, ModuleNotFoundError) or not exc.name:
            return None
        module = exc.name.partition(".")[0]
        extra = EXTRA_OF_MODULE.get(module)
        return cls(module, extra) if extra is not None else None


def require_extra(module: str) -> None:
    """Raise `MissingExtra` unless `module` (a key of EXTRA_OF_MODULE) can be imported.

    For work that would fail later in a child process (a sim worker) or after a long
    set-up: finds the module without importing it.
    """
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtra(module, EXTRA_OF_MODULE[module])


class OutputRefused(InvalidInput):
    """An output path that ftctl will not replace (a device, FIFO, socket, directory, or a
    symbolic link out of its directory); exit 2, before any work is done."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class Unreachable(FtctlError):
    """The target did not answer: connection refused, reset, timed out, missing."""

    exit_code = ExitCode.UNREACHABLE


class LockTimeout(FtctlError):
    """A lock was not acquired within the requested timeout."""

    exit_code = ExitCode.LOCK_TIMEOUT


class LeaseLost(FtctlError):
    """The holder lost the lock (etcd lease expired, lock file deleted or replaced): stop
    serving now; another engine may hold it already (its fencing token is higher)."""

    exit_code = ExitCode.LEASE_LOST


class Interrupted(FtctlError):
    """The user interrupted the command (SIGINT)."""

    exit_code = ExitCode.INTERRUPTED
