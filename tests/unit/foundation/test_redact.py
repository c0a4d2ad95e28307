"""Secrets in URLs (`user:password@`, token query parameters) are masked in every output."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from dynamo_ftctl.output import error, warn
from dynamo_ftctl.redact import install_log_redaction, redact_text, redact_url
from tests.unit.cli.test_cli import ROOT, ftctl

SECRET_URL = "http://admin:hunter2@127.0.0.1:8101"
TOKEN_URL = "http://127.0.0.1:8102/?api_key=sk-live-123&model=m"


@pytest.mark.parametrize(("url", "masked"), [
    ("http://admin:hunter2@10.0.0.3:8000/v1", "http://admin:***@10.0.0.3:8000/v1"),
    ("https://ghp_TOKEN@github.com/x", "https://***@github.com/x"),
    ("http://h:1/v1?token=abc&model=m&access_token=z",
     "http://h:1/v1?token=***&model=m&access_token=***"),
    ("http://h/?X-Amz-Signature=s1&apiKey=k;password=p#id_token=t",
     "http://h/?X-Amz-Signature=***&apiKey=***;password=***#id_token=***"),
    ("http://u:p@[::1]:8000/x", "http://u:***@[::1]:8000/x"),
    ("http://10.0.0.3:8000/v1?model=a&monkey=b", "http://10.0.0.3:8000/v1?model=a&monkey=b"),
    ("http://[::1", "http://[::1"),
])
def test_redact_url_masks_user_info_and_secret_parameters(url: str, masked: str) -> None:
    """The password (or a bare user name: often a token) and secret parameters become ***."""
    assert redact_url(url) == masked


def test_redact_text_masks_every_url_in_a_message() -> None:
    """URLs inside free text, quoted or not, are masked; the rest is left as it was."""
    text = (f"worker w1 at {SECRET_URL!r} refused; tried {TOKEN_URL} "
            "(see http://docs.example/?page=2)")
    assert redact_text(text) == (
        "worker w1 at 'http://admin:***@127.0.0.1:8101' refused; tried "
        "http://127.0.0.1:8102/?api_key=***&model=m (see http://docs.example/?page=2)")
    assert redact_text("no url here: a=b token=c") == "no url here: a=b token=c"


@pytest.fixture
def secret_inventory(tmp_path: Path) -> Path:
    """An inventory whose worker URLs carry a password and an API key."""
    path = tmp_path / "ftctl.yaml"
    path.write_text(yaml.safe_dump({
        "cluster": "secret",
        "workers": [{"name": "w1", "url": SECRET_URL, "model": "m"},
                    {"name": "w2", "url": TOKEN_URL, "model": "m",
                     "admin": {"url": "http://ops:pa55@127.0.0.1:9000"}}],
        "proxy": {"health_url": "http://daemon:s3cret@127.0.0.1:8200"},
    }))
    return path


def test_inventory_show_masks_secrets_in_text_and_json(secret_inventory: Path) -> None:
    """`inventory show` (table and --json) prints hosts and paths but no password or key."""
    table = ftctl("-i", str(secret_inventory), "inventory", "show")
    assert table.returncode == 0, table.stderr
    assert "http://admin:***@127.0.0.1:8101" in table.stdout
    assert "http://127.0.0.1:8102/?api_key=***&model=m" in table.stdout
    doc_run = ftctl("-i", str(secret_inventory), "inventory", "show", "--json")
    assert doc_run.returncode == 0, doc_run.stderr
    for out in (table.stdout, doc_run.stdout):
        for secret in ("hunter2", "sk-live-123", "pa55", "s3cret"):
            assert secret not in out
    doc = json.loads(doc_run.stdout)
    assert doc["workers"][0]["url"] == "http://admin:***@127.0.0.1:8101"
    assert doc["workers"][1]["admin"]["url"] == "http://ops:***@127.0.0.1:9000"
    assert doc["proxy"]["health_url"] == "http://daemon:***@127.0.0.1:8200"


def test_an_invalid_url_error_line_masks_its_password(tmp_path: Path) -> None:
    """The one error line that names a bad inventory URL prints it masked."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"cluster": "c", "workers": [
        {"name": "w1", "url": "http://admin:hunter2@127.0.0.1:99999", "model": "m"}]}))
    proc = ftctl("-i", str(path), "inventory", "check")
    assert proc.returncode == 2
    assert "not a valid http(s) URL: 'http://admin:***@127.0.0.1:99999'" in proc.stderr
    assert "hunter2" not in proc.stderr


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_probe_output_masks_secrets(json_flag: tuple[str, ...]) -> None:
    """A canary probe of a URL with a password and a token names it masked, in its
    table and JSON, and its failure reason names only host:port."""
    proc = ftctl("canary", "--url", "http://admin:hunter2@127.0.0.1:9/x?token=t0k",
                 "--set", str(ROOT / "canaries" / "ftctl-sim-tiny.yaml"), "--no-state",
                 *json_flag)
    assert proc.returncode == 3, proc.stderr
    assert "http://admin:***@127.0.0.1:9/x?token=***" in proc.stdout
    assert "connection refused by 127.0.0.1:9" in proc.stdout
    for secret in ("hunter2", "t0k"):
        assert secret not in proc.stdout + proc.stderr


def test_error_and_warning_mask_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    """`output.error` and `output.warn` mask URLs in the line they print."""
    error(f"cannot reach {SECRET_URL}/v1/models")
    warn(f"slow: {TOKEN_URL}")
    err = capsys.readouterr().err
    assert "error: cannot reach http://admin:***@127.0.0.1:8101/v1/models" in err
    assert "warning: slow: http://127.0.0.1:8102/?api_key=***&model=m" in err


@pytest.fixture
def log_redaction() -> Iterator[io.StringIO]:
    """Redaction installed for this test (the process's record factory restored after);
    a handler on a fresh logger writes into the yielded buffer."""
    factory = logging.getLogRecordFactory()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("ftctl.test-redact")
    logger.addHandler(handler)
    logger.propagate = False
    install_log_redaction()
    install_log_redaction()  # idempotent: one wrapper, not two
    try:
        yield stream
    finally:
        logging.setLogRecordFactory(factory)
        logger.removeHandler(handler)


def test_log_records_mask_secrets_in_messages_and_tracebacks(log_redaction: io.StringIO) -> None:
    """A log line and the traceback logged with it carry the URL masked."""
    logger = logging.getLogger("ftctl.test-redact")
    logger.warning("scrape of %s failed", f"{SECRET_URL}/metrics")
    try:
        raise ConnectionError(f"refused: {TOKEN_URL}")
    except ConnectionError:
        logger.exception("upstream failed")
    out = log_redaction.getvalue()
    assert "scrape of http://admin:***@127.0.0.1:8101/metrics failed" in out
    assert "ConnectionError: refused: http://127.0.0.1:8102/?api_key=***&model=m" in out
    assert "hunter2" not in out
    assert "sk-live-123" not in out


def test_the_canary_daemons_worker_list_masks_secrets() -> None:
    """GET /workers (the daemon's snapshot) names each worker's URL masked."""
    from dynamo_ftctl.clock import FakeClock
    from dynamo_ftctl.health.daemon import HealthDaemon, WatchedWorker
    from dynamo_ftctl.health.probe import ProbeTarget
    from dynamo_ftctl.inventory.canary import CanaryConfig
    from tests.unit.health.fakes import SET, AsyncFakeWorkers

    clock = FakeClock()
    watched = [WatchedWorker(ProbeTarget("w1", SECRET_URL, "m"), "node-a", (0,))]
    daemon = HealthDaemon(watched, SET, CanaryConfig(), clock=clock,
                          transport=AsyncFakeWorkers(clock))
    assert daemon.snapshot()["workers"][0]["url"] == "http://admin:***@127.0.0.1:8101"


def test_drill_reports_mask_secrets(tmp_path: Path) -> None:
    """report.json, report.md and the summary name a failing URL masked."""
    from dynamo_ftctl.drill import ProbeOutcome, TimelineEvent
    from dynamo_ftctl.drill.report import DrillReport, write_report

    report = DrillReport(
        scenario="drills/x.yaml", title="x", local=False, passed=False, started_at=0.0,
        elapsed_s=1.0, error=f"{SECRET_URL}/health did not answer 200 in time",
        counts={}, latency={},
        probes=(ProbeOutcome("up", "workers_healthy", "before", False,
                             f"refused: {TOKEN_URL}"),),
        events=(TimelineEvent(0.5, "inject", f"POST {SECRET_URL}/admin/fault"),),
        rollbacks=(), states=(), out_dir=tmp_path)
    written = write_report(report, plot=False)
    for name in ("report.json", "report.md"):
        text = (tmp_path / name).read_text()
        assert "http://admin:***@127.0.0.1:8101" in text
        assert "hunter2" not in text
        assert "sk-live-123" not in text
    summary = str(written.__rich__())
    assert "hunter2" not in summary
    assert "admin:***@" in summary


def test_user_info_never_reaches_a_host_header() -> None:
    """The proxy's upstream client sends `Host: host:port`, not the URL's password."""
    from dynamo_ftctl.http1 import Pool

    key, head = Pool().head("POST", f"{SECRET_URL}/v1/completions")
    assert key == ("http", "127.0.0.1", 8101)
    assert b"\r\nHost: 127.0.0.1:8101\r\n" in head
    assert b"hunter2" not in head
