"""Each process's /metrics, live: its own families only, the proxy's request series adding
up over `--procs 2`, and every query of deploy/grafana/ftctl.json answered by them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dynamo_ftctl import metrics
from tests import fetch
from tests.integration.health.test_daemon_sim import DAEMON_TOKEN, daemon
from tests.integration.proxy.test_proxy_sim import MODEL, proxy_factory, set_fault, wait_until

if TYPE_CHECKING:
    from tests.integration.proxy.test_proxy_sim import ProxyFactory

pytestmark = pytest.mark.integration

__all__ = ["daemon", "proxy_factory"]  # fixtures

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "ftctl.json"
PROCESS = {"process_cpu_seconds_total", "process_max_fds", "process_open_fds",
           "process_resident_memory_bytes", "process_start_time_seconds",
           "process_virtual_memory_bytes", "python_info"}
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? ", re.MULTILINE)
# Labels a Prometheus server adds to every scraped series, and the histogram's own.
_TARGET_LABELS = {"instance", "job", "le"}


def _families(page: str) -> set[str]:
    """The family names of an exposition, counters with their `_total`."""
    return {f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
            for name, kind in _TYPE.findall(page)}


def _labels_by_series(page: str) -> dict[str, set[str]]:
    """Each sample name of `page` with the label names it carries."""
    found: dict[str, set[str]] = {}
    for name, labels in _SAMPLE.findall(page):
        found.setdefault(name, set()).update(
            part.split("=", 1)[0] for part in re.findall(r'(\w+)="', labels or ""))
    return found


def _declared(*kinds: str) -> dict[str, set[str]]:
    """Each series name the `kinds` of process register (with its suffixes), and its labels."""
    found: dict[str, set[str]] = {}
    for kind in kinds:
        for collector in metrics._FAMILIES[kind]:
            (family,) = collector.describe()
            labels = set(collector._labelnames)
            base = family.name
            names = ({f"{base}_total"} if family.type == "counter" else
                     {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
                     if family.type == "histogram" else {base})
            for name in names:
                found[name] = labels
    return found


def _sum(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith((name + " ", name + "{")))


def _send(url: str, count: int) -> None:
    """`count` generations, half streamed, each on a new connection (any child answers)."""
    for i in range(count):
        body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 6, "stream": i % 2 == 0}
        reply = fetch.post(f"{url}/v1/completions", json=body, timeout=30)
        assert reply.status == 200, reply.text


def _queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in doc["panels"] for target in panel["targets"]]


def _used(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses (minimal parse)."""
    labels = {label for group in re.findall(r"\b(?:by|without|on)\s*\(([^)]*)\)", expr)
              for label in re.split(r"\s*,\s*", group.strip()) if label}
    labels |= {label for group in re.findall(r"\{([^}]*)\}", expr)
               for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", group)}
    names = {n for n in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b", expr)
             if n.startswith(("dynamo_", "ftctl_", "process_", "python_"))}
    return names, labels - _TARGET_LABELS


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool accepts every dashboard query (as recording rules)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"ftctl:dashboard_{i}", "expr": expr} for i, expr in enumerate(_queries())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_process_serves_its_own_families_and_the_dashboard_finds_them(
        daemon: Any, proxy_factory: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `--procs 2` proxy over two sims with its daemon: the daemon's page has no proxy
    series and the proxy's no canary series, both have process_*, the sims only vllm:*;
    the request counter adds up over both children; every dashboard query's metrics and
    labels are on the pages."""
    daemon_url, _, workers, _ = daemon
    monkeypatch.setenv("FTCTL_HEALTH_TOKEN", DAEMON_TOKEN)
    proxy = proxy_factory([(n, w.url) for n, w in workers.items()], procs=2,
                          health_url=daemon_url)
    sent = 8
    _send(proxy.url, sent)
    # One worker cuts every stream after 3 tokens: the proxy migrates them (the
    # dashboard's migration panels need samples to check).
    set_fault(next(iter(workers.values())), {"kind": "disconnect", "after_tokens": 3})

    def migrated() -> bool:
        nonlocal sent
        _send(proxy.url, 2)
        sent += 2
        page = fetch.get(f"{proxy.url}/metrics", timeout=10).text
        return _sum(page, "dynamo_frontend_model_migration_total") > 0

    wait_until(migrated, 30.0, "a migration")

    def counted() -> bool:
        page = fetch.get(f"{proxy.url}/metrics", timeout=10).text
        return (_sum(page, "dynamo_frontend_requests_total") == sent
                and "ftctl_proxy_daemon_up{" in page
                and _sum(page, "ftctl_proxy_daemon_up") >= 1)

    wait_until(counted, 20.0, f"{sent} requests counted and the daemon read")
    proxy_page = fetch.get(f"{proxy.url}/metrics", timeout=10).text
    daemon_page = fetch.get(f"{daemon_url}/metrics", timeout=10).text

    proxy_families, daemon_families = _families(proxy_page), _families(daemon_page)
    assert proxy_families >= PROCESS
    assert daemon_families >= PROCESS
    assert not {f for f in proxy_families if f.startswith("ftctl_canary_")
                or f in {"ftctl_worker_state", "ftctl_lock_holder"}}
    assert not {f for f in daemon_families if f.startswith(("ftctl_proxy_", "dynamo_"))}
    assert daemon_families - PROCESS == {"ftctl_canary_probe_duration_seconds",
                                         "ftctl_worker_state", "ftctl_circuit_breaker_state"}
    assert {"dynamo_frontend_requests_total", "dynamo_frontend_time_to_first_token_seconds",
            "dynamo_frontend_inter_token_latency_seconds",
            "dynamo_frontend_request_duration_seconds", "dynamo_frontend_inflight_requests",
            "ftctl_proxy_daemon_up"} <= proxy_families
    assert _sum(proxy_page, "dynamo_frontend_time_to_first_token_seconds_count") == sent
    assert _sum(proxy_page, "dynamo_frontend_request_duration_seconds_count") == sent
    assert _sum(proxy_page, "dynamo_frontend_inter_token_latency_seconds_count") > 0
    assert _sum(proxy_page, "dynamo_frontend_inflight_requests") == 0
    assert 'request_type="stream"' in proxy_page
    assert 'request_type="unary"' in proxy_page
    for worker in workers.values():
        sim_page = fetch.get(f"{worker.url}/metrics", timeout=10).text
        assert all(f.startswith("vllm:") for f in _families(sim_page)), _families(sim_page)

    served = _labels_by_series(proxy_page)
    for name, labels in _labels_by_series(daemon_page).items():
        served.setdefault(name, set()).update(labels)
    # A labelled family with no sample yet in this run (no request was refused) has no
    # line on the page: it counts as served with the labels the process registers it with.
    for name, labels in _declared(metrics.PROXY, metrics.DAEMON).items():
        served.setdefault(name, labels)
    for expr in _queries():
        names, labels = _used(expr)
        assert names, expr
        missing = names - set(served)
        assert not missing, f"{expr}: {missing} not served"
        carried = set().union(*(served[n] for n in names))
        assert labels <= carried, f"{expr}: labels {labels - carried} not on {names}"
