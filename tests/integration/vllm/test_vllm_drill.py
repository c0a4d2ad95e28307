"""The shipped drills/vllm-worker-crash.yaml on the session's two real vLLM servers.

The test gives the scenario an inventory of its own naming the fixture's running servers
(no `launch`: `ftctl drill --local` uses them where they are and starts only the migrating
proxy), each signalled as a process group. The drill kills vllm2 mid-load; the `vllm_pair`
fixture starts it again for the next test.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from dynamo_ftctl.drill import run_drill
from tests.cpuquota import cpu_quota
from tests.integration.vllm.server import VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

SCENARIO = Path(__file__).parents[3] / "drills" / "vllm-worker-crash.yaml"


def running_inventory(pair: tuple[VllmServer, ...], path: Path) -> None:
    """drills/vllm.yaml's workers, pointed at the fixture's servers instead of launched."""
    shipped = yaml.safe_load((SCENARIO.parent / "vllm.yaml").read_text())
    for worker, server in zip(shipped["workers"], pair, strict=True):
        assert worker["name"] == server.name
        del worker["launch"]
        worker.update({"url": server.url, "model": server.model,
                       "process": {"pid": server.proc.pid, "group": True},
                       "inject": {"injectors": ["signal"]}})
    shipped["proxy"]["listen"] = "127.0.0.1:0"
    path.write_text(yaml.safe_dump(shipped, sort_keys=False))


def test_vllm_worker_crash_drill_continues_every_stream_token_exactly(
    vllm_pair: tuple[VllmServer, ...], tmp_path: Path,
) -> None:
    """SIGKILL of vllm2 mid-load: 0 failed requests, 0 tokens lost or repeated, and every
    witness stream the kill cut has the fault-free run's token ids."""
    running_inventory(vllm_pair, tmp_path / "vllm.yaml")
    scenario = tmp_path / SCENARIO.name
    scenario.write_text(SCENARIO.read_text())
    # vllm2 held to a tenth of a core: the tiny model writes 2,000 tokens in under a
    # second, faster than a busy machine's proxy and clients read them, so a kill timed on
    # the first token the client reads came after vllm2 had written every token (CI, at
    # least four times: 3 of 6 witnesses mid-stream on vllm2 as the client saw it, none
    # cut). At 10% its streams take ~20 s, as a GPU server's long stream takes seconds;
    # the kernel enforces that, whatever the scheduler does with everything else.
    with cpu_quota(vllm_pair[1].proc.pid, 0.1, "vllm2") as held:
        report = run_drill(scenario, local=True, out_dir=tmp_path / "out", plot=False)
    kill = report.events[0].result if report.events else ""
    seen = report.counts.get("witness") or {}
    if not held and not (seen.get("cut", 0) + seen.get("cut_failed", 0)):
        # No cgroup to write (not root, no cpu controller): the premise is left to timing,
        # and a kill that cut no witness is run once more on a restarted vllm2. Printed,
        # not warned: the suite runs with filterwarnings=error.
        print(f"vLLM drill: the kill cut no witness on vllm2, running it again: {kill}",
              file=sys.stderr)
        vllm_pair[1].restart()
        running_inventory(vllm_pair, tmp_path / "vllm.yaml")
        shutil.rmtree(tmp_path / "out")
        report = run_drill(scenario, local=True, out_dir=tmp_path / "out", plot=False)
    counts = report.counts
    proxy_log = tmp_path / "out" / "proxy.log"
    summary = "\n".join([*report.summary_lines(), "proxy.log (its end):",
                         proxy_log.read_text(errors="replace")[-3000:]
                         if proxy_log.exists() else "(none)"])
    assert report.passed, summary
    assert counts["failed"] == 0
    assert counts["tokens_lost"] == counts["tokens_duplicated"] == 0
    witness = counts["witness"]
    assert witness["cut"] >= 1, summary
    assert witness["cut_intact"] == witness["cut"]
    assert witness["ids_mismatched"] == 0
    assert not vllm_pair[1].alive, "the drill killed vllm2"
    text = (tmp_path / "out" / "report.md").read_text()
    assert f"{witness['cut']} cut and continued, {witness['cut']} of those token-identical" in text
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["requests"]["witness"] == witness
