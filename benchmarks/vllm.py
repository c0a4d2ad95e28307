"""Figures of the real-engine issue on vLLM 0.32.0 (CPU, the suite's tiny random-weight Llama).

1. Migration: STREAMS streams through `ftctl proxy` over two vLLM servers, each cut once
   the client has seen a random number of its tokens, by a TCP reset of the serving
   server's connection (a fault proxy, `faults.netproxy`, stands in front of each server;
   the reset drops what the proxy had not read, as a SIGKILL's does). The fault proxies
   pace each server's answer to PACE_KIB_S: vLLM on CPU writes a 300-token answer within
   ~1.5 s, and with the two engines spinning on the two cores the proxy and the client
   lag it, so a cut set off by the client's count often came after the end (7 of 12
   streams, unpaced). Paced, what the server wrote ahead waits in the fault proxy and
   the reset drops it: the cut falls where the client is. Chat and
   completions, greedy and seeded (T=0.9, seed per stream), in turn. Per kind it prints
   how many streams were identical to the fault-free run (token ids and text) and, for
   the seeded ones that are not, how many equal the run up to the cut and vLLM's own
   continuation of that context after it: vLLM's V1 sampler seeds one generator per
   request, so a seeded continuation cannot repeat the uninterrupted run
   (docs/compatibility.md).
2. TTFT through the proxy vs straight to vLLM: p50 of REQUESTS short completions each,
   alternating, in the same run (the ratio; these machines are shared and noisy), through
   a second proxy over the servers themselves (no fault proxy on that path).

Needs the vLLM venv (`make vllm`, or $FTCTL_VLLM_PYTHON); without it this prints a note
and exits 0. Usage: python benchmarks/vllm.py [--streams N] [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from tests.integration.vllm.server import (  # noqa: E402
    VllmServer,
    spawn_vllm,
    tiny_llama_dir,
    vllm_python,
    wait_healthy,
)

from dynamo_ftctl.faults.netproxy import NetProxy, Toxic  # noqa: E402

MAX_TOKENS = 300
KINDS = [("chat", False), ("completions", False), ("chat", True), ("completions", True)]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
RESET = Toxic(name="cut", kind="reset_peer", timeout_ms=0.0)
PACE_KIB_S = 64.0  # ~150 streamed tokens/s with their ids
PACE = Toxic(name="pace", kind="bandwidth", rate_kbps=PACE_KIB_S)


@dataclass
class Seen:
    """What a client saw of one stream."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    worker: str = ""
    migrated: int = 0
    error: str | None = None
    first_token_s: float | None = None


def body_of(kind: str, seeded: bool, index: int, model: str,
            max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    prompt = f"Stream {index}: why must a stream survive the failure of its worker?"
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                            "return_token_ids": True, "stream": True}
    body |= {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + index} if seeded \
        else {"temperature": 0.0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                 on_token: Any = None) -> Seen:
    """Stream `body` to `url`; `on_token(seen)` after each chunk with tokens."""
    seen = Seen()
    began = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        seen.worker = resp.headers.get("x-ftctl-worker", "")
        buffer = b""
        async for piece in resp.aiter_bytes():
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event.startswith(b": x-ftctl-migrated:"):
                    seen.migrated = int(event.rsplit(b":", 1)[1])
                if not event.startswith(b"data: {"):
                    continue
                doc = json.loads(event[6:])
                if "error" in doc:
                    seen.error = str(doc["error"])
                    continue
                seen.prompt_ids = seen.prompt_ids or doc.get("prompt_token_ids") or []
                for choice in doc["choices"]:
                    seen.prompt_ids = seen.prompt_ids or choice.get("prompt_token_ids") or []
                    ids = choice.get("token_ids") or []
                    seen.ids.extend(ids)
                    delta = choice.get("delta")
                    seen.text += (delta.get("content") or "") if delta is not None \
                        else choice["text"]
                    if ids and seen.first_token_s is None:
                        seen.first_token_s = time.perf_counter() - began
                    if ids and on_token is not None:
                        await on_token(seen)
    return seen


async def cut(netproxy: NetProxy) -> None:
    """Reset every connection of `netproxy` now, then let new ones through again."""
    netproxy.add_toxic(RESET)
    end = time.monotonic() + 5.0
    while netproxy.live and time.monotonic() < end:
        await asyncio.sleep(0.001)  # the reset fires on the loop's next turn
    netproxy.remove_toxic(RESET.name)


def start_proxy(urls: list[str], model: str, folder: Path) -> tuple[subprocess.Popen[bytes],
                                                                   str, Path]:
    """`ftctl proxy` over `urls` (w0, w1); its URL once it serves and its log file."""
    inventory = folder / "inventory.yaml"
    workers = "".join(f"  - {{name: w{i}, url: '{u}', model: {model}}}\n"
                      for i, u in enumerate(urls))
    inventory.write_text(f"cluster: bench-vllm\nworkers:\n{workers}proxy:\n"
                         "  listen: 127.0.0.1:0\n  breaker_threshold: 100000\n"
                         "  stall_timeout_s: 5.0\n")
    log = folder / "proxy.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory),
                                 "proxy"], stdout=subprocess.DEVNULL, stderr=sink)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        found = re.search(r"serving \d+ workers on (http://\S+)", log.read_text())
        if found:
            url = found.group(1)
            while time.monotonic() < end:  # the first scrape learns max_model_len
                doc = httpx.get(f"{url}/v1/models", timeout=5).json()
                if all("max_model_len" in entry for entry in doc["data"]):
                    return proc, url, log
                time.sleep(0.05)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    msg = f"the proxy did not start:\n{log.read_text()[-2000:]}"
    raise SystemExit(msg)


def cuts_in(log: Path) -> list[int]:
    """The token counts at which the proxy saw workers fail, in order."""
    return [int(n) for n in re.findall(r"worker failed: .*\(after (\d+) tokens\)",
                                       log.read_text())]


async def migration_figure(servers: list[VllmServer], proxies: list[NetProxy], url: str,
                           log: Path, *, streams: int, rng: random.Random,
                           dump: list[dict[str, Any]] | None = None) -> None:
    model = servers[0].model
    by_worker = {f"w{i}": np for i, np in enumerate(proxies)}
    tally: dict[tuple[str, bool], dict[str, int]] = {
        k: {"streams": 0, "identical": 0, "ids_only": 0, "consistent": 0, "not_cut": 0,
            "failed": 0}
        for k in KINDS}
    async with httpx.AsyncClient(timeout=120) as client:
        for index in range(streams):
            kind, seeded = KINDS[index % len(KINDS)]
            body = body_of(kind, seeded, index, model)
            path = PATHS[kind]
            expected = await stream(client, servers[index % 2].url + path, body)
            at = rng.randint(1, MAX_TOKENS - 1)
            fired: list[str] = []

            async def maybe_cut(seen: Seen, at: int = at, fired: list[str] = fired) -> None:
                if not fired and len(seen.ids) >= at:
                    fired.append(seen.worker.split(",")[-1])
                    await cut(by_worker[fired[0]])

            before = len(cuts_in(log))
            got = await stream(client, url + path, body, maybe_cut)
            row = tally[(kind, seeded)]
            row["streams"] += 1
            if got.error is not None or len(got.ids) != MAX_TOKENS:
                row["failed"] += 1
                print(f"  stream {index} ({kind}, seeded={seeded}, cut at {at}): "
                      f"{got.error or f'{len(got.ids)} tokens'}", flush=True)
                continue
            if not got.migrated:
                row["not_cut"] += 1  # the worker had finished before the reset
            if (got.ids, got.text) == (expected.ids, expected.text):
                row["identical"] += 1
                continue
            if got.ids == expected.ids:
                # vLLM detokenized the same ids into other text (see the module docstring).
                row["ids_only"] += 1
                if dump is not None:
                    dump.append({"stream": index, "kind": kind, "ids": got.ids,
                                 "prompt_ids": expected.prompt_ids, "text": got.text,
                                 "expected_text": expected.text, "cuts": cuts_in(log)[before:]})
                continue
            failed_at = cuts_in(log)[before:]
            if not seeded or len(failed_at) != 1:
                row["failed"] += 1
                first = next((i for i, (a, b) in enumerate(zip(got.ids, expected.ids,
                                                                strict=False)) if a != b), None)
                where = next((i for i, (a, b) in enumerate(zip(got.text, expected.text,
                                                                strict=False)) if a != b),
                             min(len(got.text), len(expected.text)))
                print(f"  stream {index} ({kind}, seeded={seeded}) differs from token {first}"
                      f", text from char {where}: {got.text[where - 5:where + 10]!r} vs "
                      f"{expected.text[where - 5:where + 10]!r}; the proxy saw failures after "
                      f"{failed_at} tokens", flush=True)
                continue
            k = failed_at[0]
            rest_body = {key: v for key, v in body.items() if key != "messages"}
            rest_body |= {"prompt": expected.prompt_ids + got.ids[:k],
                          "max_tokens": MAX_TOKENS - k}
            rest = await stream(client, servers[0].url + PATHS["completions"], rest_body)
            if got.ids[:k] == expected.ids[:k] and got.ids[k:] == rest.ids:
                row["consistent"] += 1
            else:
                row["failed"] += 1
                print(f"  stream {index} (seeded {kind}) is not prefix + vLLM's continuation",
                      flush=True)
    print(f"migration on vLLM: {streams} streams of {MAX_TOKENS} tokens, each cut once at a "
          "random token (TCP reset of the serving server's connection)")
    columns = (("streams", 7), ("identical", 9), ("ids_only", 8), ("consistent", 11),
               ("not_cut", 7), ("failed", 6))
    titles = {"ids_only": "ids only", "consistent": "prefix+vLLM", "not_cut": "not cut"}
    print(f"  {'kind':<22}" + "".join(f" {titles.get(c, c):>{w}}" for c, w in columns))
    total = {key: sum(row[key] for row in tally.values()) for key in tally[KINDS[0]]}
    rows = [(f"{kind}, {'seeded' if seeded else 'greedy'}", row)
            for (kind, seeded), row in tally.items()]
    for name, row in [*rows, ("all", total)]:
        print(f"  {name:<22}" + "".join(f" {row[c]:>{w}}" for c, w in columns))


async def ttft_figure(server: VllmServer, url: str, requests: int) -> None:
    body = body_of("completions", False, 0, server.model, max_tokens=8)
    direct: list[float] = []
    proxied: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client:
        for index in range(requests):
            body["prompt"] = f"Request {index}: the proxy's share of a first token."
            for target, out in ((server.url, direct), (url, proxied)) if index % 2 \
                    else ((url, proxied), (server.url, direct)):
                seen = await stream(client, target + PATHS["completions"], body)
                assert seen.first_token_s is not None
                out.append(seen.first_token_s)
    d, p = statistics.median(direct), statistics.median(proxied)
    print(f"TTFT on vLLM, {requests} requests each, alternating (8-token completions, one at "
          f"a time): direct p50 {d * 1e3:.1f} ms, through the proxy p50 {p * 1e3:.1f} ms, "
          f"ratio {p / d:.2f} ({(p - d) * 1e3:+.1f} ms)")


async def run(servers: list[VllmServer], folder: Path, args: argparse.Namespace) -> None:
    proxies = []
    for server in servers:
        port = int(server.url.rsplit(":", 1)[1])
        proxies.append(await NetProxy("127.0.0.1", port).start())
    proc, url, log = await asyncio.to_thread(
        start_proxy, [f"http://127.0.0.1:{np.port}" for np in proxies], servers[0].model, folder)
    try:
        for np in proxies:
            np.add_toxic(PACE)
        dump: list[dict[str, Any]] = []
        await migration_figure(servers, proxies, url, log, streams=args.streams,
                               rng=random.Random(args.seed), dump=dump)
        if args.dump is not None and dump:
            args.dump.write_text(json.dumps(dump))
            print(f"  ({len(dump)} streams with equal ids and other text: {args.dump})")
    finally:
        proc.terminate()
        proc.wait(10)
        for np in proxies:
            await np.stop()
    # TTFT straight to a server vs through a proxy straight over both (no fault proxy).
    direct = folder / "direct"
    direct.mkdir()
    proc, url, _ = await asyncio.to_thread(
        start_proxy, [s.url for s in servers], servers[0].model, direct)
    try:
        await ttft_figure(servers[0], url, args.requests)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dump", type=Path, help="write streams whose text differs here")
    args = parser.parse_args()
    python = vllm_python()
    if not python.exists():
        print(f"benchmarks/vllm.py: no vLLM venv at {python} (make vllm): skipped")
        return 0
    model = tiny_llama_dir(python)
    with tempfile.TemporaryDirectory(prefix="ftctl-bench-vllm-") as tmp:
        folder = Path(tmp)
        cpus = sorted(os.sched_getaffinity(0))
        servers = [spawn_vllm(python, model, folder / f"vllm{i}.log", name=f"vllm{i}",
                              cpu=cpus[i % len(cpus)]) for i in range(2)]
        try:
            began = time.monotonic()
            for server in servers:
                wait_healthy(server, began)
            asyncio.run(run(servers, folder, args))
        finally:
            for server in servers:
                server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
