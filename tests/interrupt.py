"""Child processes that take Ctrl-C as they would from a terminal, however the test run
itself was started."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_deliverable() -> Iterator[None]:
    """Processes started inside this block begin with SIGINT at its default disposition.

    A run started in the background of a non-interactive shell (`make test &`) inherits
    SIGINT ignored; an ignored signal stays ignored across exec, and Python then leaves
    it so, as a program should: such a child would never see the test's Ctrl-C. A
    handler, unlike SIG_IGN, is reset to the default by exec. Main thread only (where
    pytest runs tests)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
