"""Figures of ftctl's KV connector (issue 34) on vLLM 0.32.0 (CPU, the tiny random-weight Llama).

Two servers in one run, one core each, both with prefix caching off (so a server's
`cached_tokens` can only come from the connector's store): `kv` runs FtctlConnector on a
temporary store, `plain` runs without a connector.

1. Recomputed tokens after a cut. For prompts of 512, 1,024 and 1,792 tokens: the prompt
   is generated on for CUT_AT tokens on `kv` (which saves its blocks as they fill), then
   prompt + those tokens is sent again, as the proxy's re-prefill does after a cut, to
   `kv` (standing in for a second worker on the same store: its own cache is off) and to
   `plain`. Recomputed = prompt tokens - cached_tokens; the continued answers must match.
2. Save overhead. REPEATS fresh prompts of each length (new ids: every block is saved),
   generating CUT_AT tokens, on `kv` and on `plain` in turn; tokens/s = (prompt +
   generated) / wall time. The ratio kv / plain, same run (these machines are shared).

Needs the vLLM venv (`make vllm`, or $FTCTL_VLLM_PYTHON); without it this prints a note
and exits 0. Usage: python benchmarks/vllm_connector.py [--repeats N] [--swap-cores]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

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

LENGTHS = (512, 1024, 1792)
CUT_AT = 64
BLOCK = 128


def prompt_ids(length: int, salt: int) -> list[int]:
    """Deterministic ids in the tiny vocabulary; another salt, other blocks."""
    return [(i * 7919 + salt * 104729) % 1900 + 5 for i in range(length)]


def complete(server: VllmServer, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    resp = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "return_token_ids": True, "ignore_eos": True})
    resp.raise_for_status()
    doc = resp.json()
    cached = (doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return doc["choices"][0]["token_ids"], cached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--swap-cores", action="store_true",
                        help="kv on the last core, plain on the first (a core's own load shows)")
    args = parser.parse_args()
    python = vllm_python()
    if not python.exists():
        print(f"no vLLM venv at {python}: run `make vllm` (or set FTCTL_VLLM_PYTHON)")
        return 0
    model = tiny_llama_dir(python)
    with tempfile.TemporaryDirectory(prefix="ftctl-kvconn-") as tmp:
        store = Path(tmp) / "store"
        config = json.dumps({
            "kv_connector": "FtctlConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "dynamo_ftctl.vllm_connector",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store), "budget_bytes": 1 << 30}})
        common = ("--enable-prompt-tokens-details", "--no-enable-prefix-caching",
                  "--max-model-len", "2048")
        cpus = sorted(os.sched_getaffinity(0))
        if args.swap_cores:
            cpus.reverse()
        servers: list[VllmServer] = []
        try:
            began = time.monotonic()
            servers.append(spawn_vllm(python, model, Path(tmp) / "kv.log", name="kv",
                                      cpu=cpus[0], extra_args=(
                                          "--kv-transfer-config", config, *common)))
            servers.append(spawn_vllm(python, model, Path(tmp) / "plain.log", name="plain",
                                      cpu=cpus[-1], extra_args=common))
            for server in servers:
                wait_healthy(server, began)
            kv, plain = servers
            print(f"vLLM 0.32.0 CPU, tiny Llama (1 KiB of KV per token, {BLOCK}-token "
                  f"blocks), cut after {CUT_AT} generated tokens")
            print(f"{'prompt':>7} {'continued':>9} {'recomputed kv':>14} "
                  f"{'recomputed plain':>17} {'same output':>11}")
            for length in LENGTHS:
                prompt = prompt_ids(length, 0)
                first, _ = complete(kv, prompt, CUT_AT + 16)
                continued = prompt + first[:CUT_AT]
                after_kv, cached_kv = complete(kv, continued, 16)
                after_plain, cached_plain = complete(plain, continued, 16)
                same = after_kv == after_plain == first[CUT_AT:]
                print(f"{length:>7} {len(continued):>9} {len(continued) - cached_kv:>14} "
                      f"{len(continued) - cached_plain:>17} {same!s:>11}")
            print(f"\nsave overhead: tokens/s (prompt + {CUT_AT} generated), "
                  f"{args.repeats} fresh prompts each, kv and plain in turn")
            print(f"{'prompt':>7} {'kv tok/s':>9} {'plain tok/s':>12} {'ratio':>6}")
            for length in LENGTHS:
                rates: dict[str, list[float]] = {"kv": [], "plain": []}
                for repeat in range(args.repeats):
                    prompt = prompt_ids(length, 1000 + repeat * 10 + length)
                    for server in (kv, plain) if repeat % 2 == 0 else (plain, kv):
                        start = time.perf_counter()
                        complete(server, prompt, CUT_AT)
                        rates[server.name].append((length + CUT_AT)
                                                  / (time.perf_counter() - start))
                kv_rate, plain_rate = (statistics.median(rates["kv"]),
                                       statistics.median(rates["plain"]))
                print(f"{length:>7} {kv_rate:>9.0f} {plain_rate:>12.0f} "
                      f"{kv_rate / plain_rate:>6.3f}")
            held = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
            files = sum(1 for p in store.rglob("*") if p.is_file())
            print(f"\nstore: {files} block files, {held / 1024:.0f} KiB "
                  f"({held / max(1, files) / BLOCK:.0f} bytes per token with headers)")
        finally:
            for server in servers:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
