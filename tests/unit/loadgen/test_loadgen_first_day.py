"""`ftctl load`'s first-day defects (issue 32): the status line is labelled and one line,
a missing matplotlib is said before the run, and a run where every request failed is no
success."""

from __future__ import annotations

import importlib.util
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from dynamo_ftctl.cli.main import app
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.loadgen.export import report_paths
from dynamo_ftctl.loadgen.render import render_progress
from dynamo_ftctl.loadgen.runner import Progress

counts = st.integers(min_value=0, max_value=10**9)


@given(t=st.floats(0, 1e6), sent=counts, done=counts, failed=counts, flight=counts,
       rate=st.floats(0, 1e6), ttft=st.none() | st.floats(0, 1e7),
       planned=st.none() | counts)
def test_the_status_line_is_one_labelled_line(t: float, sent: int, done: int, failed: int,
                                              flight: int, rate: float, ttft: float | None,
                                              planned: int | None) -> None:
    """Whatever the figures: one line, saying it is ftctl load's, naming each figure (the
    live view also cuts it at the terminal's width instead of wrapping it)."""
    line = render_progress(Progress(t, sent, done, failed, flight, rate, ttft),
                           planned=planned)
    assert "\n" not in line
    assert line.startswith("ftctl load ")
    for word in ("sent", "done", "failed", "in flight", "req/s", "p99 TTFT"):
        assert word in line


def test_a_missing_matplotlib_is_said_before_the_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out` with plots and no matplotlib: InvalidInput from the pre-run check (exit 2),
    nothing sent; `--no-plot` passes the check."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(InvalidInput, match="--no-plot"):
        report_paths(tmp_path / "out", plot=True)
    report_paths(tmp_path / "out", plot=False)
    hits: list[str] = []
    with _server(404, hits) as url:
        result = CliRunner().invoke(app, ["load", "--url", url, "--requests", "3",
                                          "--rate", "100", "--out", str(tmp_path / "run")])
    # (in-process the error propagates; `ftctl`'s entry point maps InvalidInput to exit 2)
    assert isinstance(result.exception, InvalidInput), result.output
    assert InvalidInput.exit_code == 2
    assert hits == []
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("status", [404, 500])
def test_a_run_where_every_request_failed_exits_1(status: int) -> None:
    """An all-404 (or all-500) run measured nothing: exit 1, not 0."""
    hits: list[str] = []
    with _server(status, hits) as url:
        result = CliRunner().invoke(app, ["load", "--url", url, "--requests", "4",
                                          "--rate", "100", "--json"])
    assert len(hits) == 4
    assert result.exit_code == 1, result.output


class _Handler(BaseHTTPRequestHandler):
    status = 404
    hits: list[str]

    def do_POST(self) -> None:
        self.hits.append(self.path)
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        body = b'{"error": {"message": "no such model"}}'
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


class _server:  # noqa: N801 (used as a context manager, like a function)
    """A loopback server answering every POST with `status`, counting requests."""

    def __init__(self, status: int, hits: list[str]) -> None:
        handler = type("H", (_Handler,), {"status": status, "hits": hits})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *_: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


