"""The load-vs-recompute crossover of ftctl's KV connector on vLLM 0.32.0 (CPU, the tiny
random-weight Llama), measured by `ftctl migrate calibrate --via store` (issue 34).

Two servers, one core each, with FtctlConnector on one temporary store and vLLM's
defaults otherwise (prefix caching on), and an inventory naming them; then the CLI itself:

    ftctl -i INVENTORY migrate calibrate --worker kv1 --to kv2 --via store \\
        --lengths LENGTHS --repeats N -o CALIBRATION

whose table (median seconds per context length, loaded from the store and recomputed, on
kv2) and fitted crossover this prints. With `--json`, the calibration file's contents.

Needs the vLLM venv (`make vllm`, or $FTCTL_VLLM_PYTHON); without it this prints a note
and exits 0. Usage: python benchmarks/vllm_calibrate.py [--repeats N] [--lengths L,L,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.vllm.server import (  # noqa: E402
    VllmServer,
    spawn_vllm,
    tiny_llama_dir,
    vllm_python,
    wait_healthy,
)

LENGTHS = "256,512,768,1024,1280,1536,1792"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default=LENGTHS)
    parser.add_argument("--json", action="store_true", help="print the calibration file")
    args = parser.parse_args()
    python = vllm_python()
    if not python.exists():
        print(f"no vLLM venv at {python}: run `make vllm` (or set FTCTL_VLLM_PYTHON)")
        return 0
    model = tiny_llama_dir(python)
    with tempfile.TemporaryDirectory(prefix="ftctl-kvcal-") as tmp:
        config = json.dumps({
            "kv_connector": "FtctlConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "dynamo_ftctl.vllm_connector",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(Path(tmp) / "store"),
                                          "budget_bytes": 1 << 30}})
        args_vllm = ("--kv-transfer-config", config, "--enable-prompt-tokens-details",
                     "--max-model-len", "2048")
        cpus = sorted(os.sched_getaffinity(0))
        servers: list[VllmServer] = []
        try:
            began = time.monotonic()
            for index in range(2):
                name = f"kv{index + 1}"
                servers.append(spawn_vllm(python, model, Path(tmp) / f"{name}.log", name=name,
                                          cpu=cpus[index % len(cpus)], extra_args=args_vllm))
            for server in servers:
                wait_healthy(server, began)
            inventory = Path(tmp) / "inventory.yaml"
            inventory.write_text(json.dumps({"cluster": "kvcal", "workers": [
                {"name": s.name, "url": s.url, "model": s.model} for s in servers]}))
            output = Path(tmp) / "calibration.json"
            command = [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "migrate",
                       "calibrate", "--worker", "kv1", "--to", "kv2", "--via", "store",
                       "--lengths", args.lengths, "--repeats", str(args.repeats),
                       "--timeout", "300", "-o", str(output)]
            print("vLLM 0.32.0 CPU, tiny Llama, one core per server, store on", tmp)
            print("$", " ".join(["ftctl", *command[3:]]), flush=True)
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "120"}
            done = subprocess.run(command, env=env, check=False, timeout=3600)
            if done.returncode != 0:
                return done.returncode
            if args.json:
                print(output.read_text())
        finally:
            for server in servers:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
