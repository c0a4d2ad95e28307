"""The target's own counters around a load run: scrape Prometheus `/metrics` before and
after, and report each counter family's change beside the load generator's figures.

`ftctl load` counts what its client sees (a stream moved by Dynamo's frontend looks
like any other answer); the server counts what it did. `watch_server_metrics` scrapes
every `--metrics-url` before and after a run and attaches one `ServerMetrics` per URL
to the report. Counters are summed over their labels (one figure per family, under
its full exposed name, `_total` included); the families of `KNOWN_COUNTERS` come
first, then any other counter whose name speaks of migrations, preemptions, errors or
requests, at most `MAX_FAMILIES` in all.

A scrape never fails the run: a refused connection, a timeout, an answer that is not
200, a redirect (not followed), a content type that is not Prometheus text, a body past
`SCRAPE_LIMIT` bytes or one the parser refuses becomes the `error` of that URL's
entry. Only a malformed URL is refused, before the run (`parse_metrics_url`).
prometheus_client's parser and the HTTP client load only when a scrape runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from dynamo_ftctl.http1 import Client

__all__ = [
    "KNOWN_COUNTERS",
    "MAX_FAMILIES",
    "SCRAPE_LIMIT",
    "SCRAPE_TIMEOUT_S",
    "CounterChange",
    "Scrape",
    "ServerMetrics",
    "diff_scrapes",
    "parse_counters",
    "parse_metrics_url",
    "scrape_metrics",
    "scrape_metrics_async",
    "server_migrations",
    "watch_server_metrics",
]

# Engines' and frontends' pages hold hundreds of series; 8 MiB leaves room for many
# thousands of label sets and bounds what is read and parsed.
SCRAPE_LIMIT = 8 * 1024 * 1024
SCRAPE_TIMEOUT_S = 5.0  # the whole exchange: connect, headers and body
MAX_FAMILIES = 64  # families reported per URL

# The server counters that say what happened to the load, by the server that exports
# them: (full exposed name, source). Names from Dynamo 1.6's prometheus_names
# (`dynamo_frontend_*`, `dynamo_component_*`), vLLM's v1 metrics, SGLang's, and ftctl's
# own proxy (`dynamo_ftctl.metrics`, which mirrors Dynamo's migration counter).
KNOWN_COUNTERS: tuple[tuple[str, str], ...] = (
    ("dynamo_frontend_model_migration_total", "dynamo frontend / ftctl proxy"),
    ("dynamo_frontend_model_migration_max_seq_len_exceeded_total", "dynamo frontend"),
    ("dynamo_frontend_requests_total", "dynamo frontend"),
    ("dynamo_frontend_requests_started_total", "dynamo frontend"),
    ("dynamo_frontend_failures_total", "dynamo frontend"),
    ("dynamo_frontend_model_cancellation_total", "dynamo frontend"),
    ("dynamo_frontend_model_rejection_total", "dynamo frontend"),
    ("dynamo_component_requests_total", "dynamo worker"),
    ("dynamo_component_errors_total", "dynamo worker"),
    ("ftctl_migrations_total", "ftctl proxy"),
    ("ftctl_proxy_rejected_requests_total", "ftctl proxy"),
    ("ftctl_proxy_query_of_death_total", "ftctl proxy"),
    ("ftctl_proxy_retry_budget_exhausted_total", "ftctl proxy"),
    ("ftctl_proxy_backpressure_total", "ftctl proxy"),
    ("vllm:num_preemptions_total", "vllm"),
    ("vllm:request_success_total", "vllm"),
    ("vllm:corrupted_requests_total", "vllm"),
    ("sglang:num_retracted_requests_total", "sglang"),
    ("sglang:num_requests_total", "sglang"),
    ("sglang:num_aborted_requests_total", "sglang"),
)
_KNOWN = dict(KNOWN_COUNTERS)
# Other counters worth a line: what a fault-tolerance run asks of a server.
_INTERESTING = re.compile(r"migrat|preempt|retract|error|fail|abort|reject|cancel|request")
_CONTENT_TYPES = ("text/plain", "application/openmetrics-text")

T = TypeVar("T")


def parse_metrics_url(text: str, *, what: str = "--metrics-url") -> str:
    """`text` as a URL to scrape: http(s), a host, and `/metrics` when no path is given.

    Raises `InvalidInput` (exit 2) naming `what` for anything else.
    """
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:
        parts, port = None, None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or any(c.isspace() for c in text) or parts.fragment):
        msg = f"{what}: {text!r} is not an http(s) URL of a Prometheus /metrics page"
        raise InvalidInput(msg)
    del port
    if parts.path in ("", "/"):
        return parts._replace(path="/metrics").geturl()
    return text


@dataclass(frozen=True)
class Scrape:
    """One read of a `/metrics` page: its counters, or why there are none."""

    url: str
    counters: dict[str, float]
    error: str | None = None


@dataclass(frozen=True)
class CounterChange:
    """One counter family over the run, summed over its labels (None: not exported then)."""

    name: str
    source: str
    before: float | None
    after: float | None

    @property
    def delta(self) -> float | None:
        """after - before; None when either is missing or the counter went down (reset)."""
        before = 0.0 if self.before is None and self.after is not None else self.before
        if before is None or self.after is None or self.after < before:
            return None
        return self.after - before


@dataclass(frozen=True)
class ServerMetrics:
    """What one server's counters did over a run, or why they could not be read."""

    url: str
    counters: tuple[CounterChange, ...]
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form (in `--json` and summary.json under `server_metrics`)."""
        from dynamo_ftctl.redact import redact_url

        return {
            "url": redact_url(self.url),
            "error": self.error,
            "counters": [{"name": c.name, "source": c.source, "before": c.before,
                          "after": c.after, "delta": c.delta} for c in self.counters],
        }


def parse_counters(text: str) -> dict[str, float]:
    """Every counter of a Prometheus text page, summed over its labels, by exposed name.

    A counter's samples are `<family>_total` (`_created` is left out); an untyped
    sample whose name ends in `_total` counts too. Raises ValueError for a page
    prometheus_client's parser refuses.
    """
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "unknown", "untyped"):
            continue
        for sample in family.samples:
            name = sample.name
            if name.endswith("_created") or (family.type != "counter"
                                              and not name.endswith("_total")):
                continue
            if math.isfinite(sample.value):
                sums[name] = sums.get(name, 0.0) + sample.value
    return sums


async def scrape_metrics_async(urls: Sequence[str], *, timeout_s: float = SCRAPE_TIMEOUT_S,
                               limit: int = SCRAPE_LIMIT,
                               client: Client | None = None) -> tuple[Scrape, ...]:
    """Scrape every URL at once; each answer or failure as a `Scrape`, in order."""
    from dynamo_ftctl.http1 import Client

    own = client is None
    http = Client() if client is None else client
    try:
        return tuple(await asyncio.gather(
            *(_scrape_one(http, url, timeout_s, limit) for url in urls)))
    finally:
        if own:
            await http.close()


def scrape_metrics(urls: Sequence[str], *, timeout_s: float = SCRAPE_TIMEOUT_S,
                   limit: int = SCRAPE_LIMIT) -> tuple[Scrape, ...]:
    """`scrape_metrics_async` for blocking code (on its own event loop)."""
    return asyncio.run(scrape_metrics_async(urls, timeout_s=timeout_s, limit=limit))


async def _scrape_one(client: Client, url: str, timeout_s: float, limit: int) -> Scrape:
    from dynamo_ftctl.http1 import BodyTooLarge, HttpError

    try:
        async with asyncio.timeout(timeout_s):
            response = await client.request(
                "GET", url, headers={"Accept": "text/plain;version=0.0.4"})
            async with response:
                status = response.status
                if status is not None and 300 <= status < 400:
                    return Scrape(url, {}, f"HTTP {status}: redirects are not followed")
                if status != 200:
                    return Scrape(url, {}, f"HTTP {status}")
                kind = (response.header("content-type") or "").split(";")[0].strip().lower()
                if kind and kind not in _CONTENT_TYPES:
                    return Scrape(url, {}, f"not Prometheus text (content type {kind!r})")
                body = await response.read(limit)
    except TimeoutError:
        return Scrape(url, {}, f"no whole answer within {timeout_s:g} s")
    except BodyTooLarge:
        return Scrape(url, {}, f"answer larger than {limit:,} bytes")
    except HttpError as exc:
        return Scrape(url, {}, f"unreachable: {exc}")
    try:
        return Scrape(url, parse_counters(body.decode("utf-8")))
    except (ValueError, UnicodeDecodeError) as exc:  # the parser's errors are ValueErrors
        return Scrape(url, {}, f"not Prometheus text: {str(exc)[:200]}")


def diff_scrapes(before: Scrape, after: Scrape) -> ServerMetrics:
    """The change of each reported counter family between two scrapes of one URL."""
    errors = [f"{when}: {s.error}" for when, s in (("before", before), ("after", after))
              if s.error]
    if errors:
        return ServerMetrics(before.url, (), "; ".join(errors))
    names = [name for name, _ in KNOWN_COUNTERS
             if name in before.counters or name in after.counters]
    others = sorted(name for name in {*before.counters, *after.counters}
                    if name not in _KNOWN and _INTERESTING.search(name))
    chosen = (names + others)[:MAX_FAMILIES]
    return ServerMetrics(before.url, tuple(
        CounterChange(name, _KNOWN.get(name, ""), before.counters.get(name),
                      after.counters.get(name)) for name in chosen))


# The family that counts a server's migrations, by preference: Dynamo's (which the ftctl
# proxy mirrors, so it is not counted twice with ftctl's own), then ftctl's.
_MIGRATION_FAMILIES = ("dynamo_frontend_model_migration_total", "ftctl_migrations_total")


def server_migrations(servers: Sequence[ServerMetrics]) -> float | None:
    """Migrations the servers counted over the run, summed over the URLs that export a
    migration counter (None: none does, or a scrape failed)."""
    total: float | None = None
    for server in servers:
        by_name = {c.name: c for c in server.counters}
        for name in _MIGRATION_FAMILIES:
            if name in by_name:
                delta = by_name[name].delta
                if delta is not None:
                    total = (total or 0.0) + delta
                break
    return total


def watch_server_metrics(urls: Sequence[str], run: Callable[[], T], *,
                         timeout_s: float = SCRAPE_TIMEOUT_S,
                         limit: int = SCRAPE_LIMIT) -> T:
    """Run `run()` between two scrapes of every URL; its result (a dataclass with a
    `server_metrics` field, as `LoadReport`) with one `ServerMetrics` per URL.

    The scrapes never raise: a failed one is that URL's `error`.
    """
    before = scrape_metrics(urls, timeout_s=timeout_s, limit=limit)
    result = run()
    after = scrape_metrics(urls, timeout_s=timeout_s, limit=limit)
    changes = tuple(diff_scrapes(b, a) for b, a in zip(before, after, strict=True))
    return dataclasses.replace(result, server_metrics=changes)  # type: ignore[type-var]
