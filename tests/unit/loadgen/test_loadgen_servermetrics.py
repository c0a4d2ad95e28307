"""`ftctl load --metrics-url`: parsing, diffing and scraping a server's counters, including
servers that answer with garbage, endless or huge bodies, redirects and wrong types."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.httpserver import listen_streams
from dynamo_ftctl.loadgen.servermetrics import (
    MAX_FAMILIES,
    Scrape,
    ServerMetrics,
    diff_scrapes,
    parse_counters,
    parse_metrics_url,
    scrape_metrics_async,
    server_migrations,
    watch_server_metrics,
)

DYNAMO_PAGE = """\
# HELP dynamo_frontend_model_migration_total Total number of request migrations due to worker unavailability
# TYPE dynamo_frontend_model_migration_total counter
dynamo_frontend_model_migration_total{migration_type="ongoing_request",model="m"} 3
dynamo_frontend_model_migration_total{migration_type="new_request",model="m"} 2
# TYPE dynamo_frontend_requests_total counter
dynamo_frontend_requests_total{endpoint="completions",model="m",request_type="stream",status="success"} 10
dynamo_frontend_requests_total{endpoint="completions",model="m",request_type="stream",status="error"} 1
# TYPE dynamo_frontend_inflight_requests gauge
dynamo_frontend_inflight_requests{model="m"} 4
# TYPE dynamo_frontend_request_duration_seconds histogram
dynamo_frontend_request_duration_seconds_bucket{le="+Inf",model="m"} 11
dynamo_frontend_request_duration_seconds_count{model="m"} 11
dynamo_frontend_request_duration_seconds_sum{model="m"} 2.5
"""

VLLM_PAGE = """\
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{finished_reason="length",model_name="m"} 6.0
untyped_errors_total 4
"""


def test_counters_are_summed_over_labels_under_their_full_names() -> None:
    """Each counter family is one figure (labels summed), named `…_total`; gauges,
    histograms and `_created` samples are left out; an untyped `…_total` counts."""
    assert parse_counters(DYNAMO_PAGE) == {
        "dynamo_frontend_model_migration_total": 5.0,
        "dynamo_frontend_requests_total": 11.0,
    }
    assert parse_counters(VLLM_PAGE) == {
        "vllm:num_preemptions_total": 7.0,
        "vllm:request_success_total": 11.0,
        "untyped_errors_total": 4.0,
    }


def test_garbage_is_refused_by_the_parser() -> None:
    """A page that is not Prometheus text raises ValueError (the scrape reports it)."""
    with pytest.raises(ValueError):  # noqa: PT011 - the parser's message varies
        parse_counters("<html><body>hello</body></html>\n")


def test_diff_puts_known_families_first_and_keeps_deltas_honest() -> None:
    """Known families come first in catalogue order; a family that appeared during the run
    counts from 0; a counter that went down is a reset (no delta)."""
    before = Scrape("u", {"vllm:request_success_total": 10.0,
                          "dynamo_frontend_model_migration_total": 2.0,
                          "zzz_errors_total": 5.0, "boring_tokens_total": 1.0})
    after = Scrape("u", {"vllm:request_success_total": 30.0,
                         "dynamo_frontend_model_migration_total": 7.0,
                         "vllm:num_preemptions_total": 3.0,
                         "zzz_errors_total": 1.0, "boring_tokens_total": 9.0})
    result = diff_scrapes(before, after)
    assert result.error is None
    names = [c.name for c in result.counters]
    assert names == ["dynamo_frontend_model_migration_total", "vllm:num_preemptions_total",
                     "vllm:request_success_total", "zzz_errors_total"]
    by_name = {c.name: c for c in result.counters}
    assert by_name["dynamo_frontend_model_migration_total"].delta == 5.0
    assert by_name["vllm:num_preemptions_total"].delta == 3.0  # appeared: from 0
    assert by_name["zzz_errors_total"].delta is None  # went down: a restart
    assert server_migrations([result]) == 5.0


def test_diff_of_a_failed_scrape_is_its_error_and_the_families_are_capped() -> None:
    """Either scrape failing gives that URL an error and no figures; at most MAX_FAMILIES
    families are reported."""
    failed = diff_scrapes(Scrape("u", {}, "HTTP 404"), Scrape("u", {"a_total": 1.0}))
    assert failed.error == "before: HTTP 404"
    assert failed.counters == ()
    assert server_migrations([failed]) is None
    many = {f"x{i}_requests_total": float(i) for i in range(1000)}
    assert len(diff_scrapes(Scrape("u", many), Scrape("u", many)).counters) == MAX_FAMILIES


def test_ftctl_proxy_migrations_are_not_counted_twice() -> None:
    """A proxy exports Dynamo's mirror and its own counter: the mirror alone is counted."""
    both = {"dynamo_frontend_model_migration_total": 1.0, "ftctl_migrations_total": 1.0}
    later = {"dynamo_frontend_model_migration_total": 4.0, "ftctl_migrations_total": 4.0}
    assert server_migrations([diff_scrapes(Scrape("u", both), Scrape("u", later))]) == 3.0
    own = diff_scrapes(Scrape("v", {"ftctl_migrations_total": 0.0}),
                       Scrape("v", {"ftctl_migrations_total": 2.0}))
    assert server_migrations([own]) == 2.0


@pytest.mark.parametrize(("given", "expected"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/metrics"),
    ("https://frontend.example:443/custom/metrics", "https://frontend.example:443/custom/metrics"),
    ("http://[::1]:9/metrics", "http://[::1]:9/metrics"),
])
def test_metrics_urls_are_accepted_and_completed(given: str, expected: str) -> None:
    """An http(s) URL is taken; a bare base URL gets /metrics."""
    assert parse_metrics_url(given) == expected


@pytest.mark.parametrize("bad", ["", "127.0.0.1:8000", "ftp://h/metrics", "http://",
                                 "http://h:99999/metrics", "http://h:x/metrics",
                                 "http://h /metrics", "http://h/metrics#frag"])
def test_bad_metrics_urls_name_the_option(bad: str) -> None:
    """A URL that cannot be scraped is InvalidInput naming --metrics-url."""
    with pytest.raises(InvalidInput, match=r"^--metrics-url: "):
        parse_metrics_url(bad)


def test_watch_replaces_the_server_metrics_of_the_result() -> None:
    """The run's result comes back with one ServerMetrics per URL, a failed scrape an
    error, and the run itself is not disturbed."""
    @dataclasses.dataclass(frozen=True)
    class Result:
        value: int
        server_metrics: tuple[ServerMetrics, ...] = ()

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = watch_server_metrics([f"http://127.0.0.1:{port}/metrics"], lambda: Result(7),
                                  timeout_s=2.0)
    assert result.value == 7
    (server,) = result.server_metrics
    assert server.error is not None
    assert server.error.startswith("before: unreachable")


# ---------------------------------------------------------------------------------------
# scraping real loopback servers that misbehave

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """A raw HTTP server on a free loopback port running `handler` per connection."""
    tasks: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await reader.readuntil(b"\r\n\r\n")
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await listen_streams(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await server.wait_closed()


def answer(status: str, body: bytes, content_type: str = "text/plain; version=0.0.4",
           extra: str = "") -> Handler:
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{extra}"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
    return handler


async def endless(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A chunked body that never ends."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    line = b"a_total 1\n" * 1000
    while True:
        writer.write(b"%x\r\n%s\r\n" % (len(line), line))
        await writer.drain()


async def stalls(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Headers, then nothing."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(60)


def scrape_from(handler: Handler, **kwargs: float) -> Scrape:
    async def go() -> Scrape:
        async with serving(handler) as url:
            (result,) = await scrape_metrics_async([url], **kwargs)  # type: ignore[arg-type]
            return result
    return asyncio.run(asyncio.wait_for(go(), 20))


def test_a_good_page_is_scraped() -> None:
    """A 200 text/plain page gives its counters."""
    result = scrape_from(answer("200 OK", DYNAMO_PAGE.encode()))
    assert result.error is None
    assert result.counters["dynamo_frontend_model_migration_total"] == 5.0


@pytest.mark.parametrize(("handler", "error"), [
    (answer("200 OK", b"\x00\xffnot metrics at all {{{\n"), "not Prometheus text"),
    (answer("200 OK", b"<html>hi</html>", "text/html"), "content type 'text/html'"),
    (answer("200 OK", b"{}", "application/json"), "content type 'application/json'"),
    (answer("404 Not Found", b"no"), "HTTP 404"),
    (answer("500 Internal Server Error", b""), "HTTP 500"),
    (answer("302 Found", b"", extra="Location: http://127.0.0.1:1/metrics\r\n"),
     "HTTP 302: redirects are not followed"),
])
def test_hostile_answers_become_errors(handler: Handler, error: str) -> None:
    """Garbage, a wrong content type, an error status and a redirect are each reported as
    that URL's error, never raised."""
    result = scrape_from(handler)
    assert result.counters == {}
    assert result.error is not None
    assert error in result.error


def test_an_endless_body_stops_at_the_limit() -> None:
    """A body that never ends is cut at the size limit, promptly."""
    started = time.monotonic()
    result = scrape_from(endless, limit=256 * 1024, timeout_s=10.0)
    assert result.error == f"answer larger than {256 * 1024:,} bytes"
    assert time.monotonic() - started < 5


def test_a_stalled_body_times_out() -> None:
    """A server that sends headers and then nothing is given up on at the timeout."""
    started = time.monotonic()
    result = scrape_from(stalls, timeout_s=0.5)
    assert result.error == "no whole answer within 0.5 s"
    assert time.monotonic() - started < 5


def test_a_million_series_is_refused_by_size_and_many_thousands_are_summed() -> None:
    """10^6 series (~25 MB) pass the 8 MiB bound and are refused unparsed; 50,000 series
    within it are summed into one family."""
    million = b"".join(b'a_total{i="%d"} 1\n' % i for i in range(1_000_000))
    result = scrape_from(answer("200 OK", million))
    assert result.error is not None
    assert result.error.startswith("answer larger than")
    many = b"# TYPE b_total counter\n" + b"".join(
        b'b_total{i="%d"} 2\n' % i for i in range(50_000))
    assert scrape_from(answer("200 OK", many)).counters == {"b_total": 100_000.0}


def test_cli_refuses_a_bad_metrics_url_before_the_run() -> None:
    """A malformed --metrics-url exits 2 with one line naming the option, sending nothing."""
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "load", "--url", "http://127.0.0.1:9",
         "--requests", "1", "--metrics-url", "ftp://nowhere/metrics"],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--metrics-url" in lines[0]


def test_report_json_and_table_carry_the_server_counters() -> None:
    """LoadReport's JSON has server_metrics and server_migrated; its table renders them."""
    from rich.console import Console

    from dynamo_ftctl.loadgen import LoadConfig, Schedule
    from dynamo_ftctl.loadgen.runner import LoadReport
    from dynamo_ftctl.loadgen.stats import summarize

    config = LoadConfig(targets=("http://127.0.0.1:9",), schedule=Schedule(rate=1), requests=1)
    server = diff_scrapes(Scrape("http://u:pw@h/metrics",
                                 {"dynamo_frontend_model_migration_total": 1.0}),
                          Scrape("http://u:pw@h/metrics",
                                 {"dynamo_frontend_model_migration_total": 4.0}))
    failed = ServerMetrics("http://h2/metrics", (), "before: HTTP 404")
    report = LoadReport(config=config, summary=summarize([], slo=config.slo, measure_from=0.0,
                                                         planned_requests=1),
                        records=(), markers=(), started_at=0.0, elapsed_s=1.0, model=None,
                        server_metrics=(server, failed))
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["server_migrated"] == 3.0
    assert doc["server_metrics"][0]["counters"] == [{
        "name": "dynamo_frontend_model_migration_total", "source": "dynamo frontend / ftctl proxy",
        "before": 1.0, "after": 4.0, "delta": 3.0}]
    assert "pw" not in json.dumps(doc)
    assert doc["server_metrics"][1]["error"] == "before: HTTP 404"
    console = Console(width=200, record=True)
    console.print(report)
    text = console.export_text()
    assert "dynamo_frontend_model_migration_total" in text
    assert "scrape failed: before: HTTP 404" in text
    assert "migrated (server counters)" in text
