"""The client side of the Dynamo tests, run inside the stack's network namespace.

The stack (frontends, mockers, the proxy) lives in a namespace the test creates; the test
process does not, so everything that talks HTTP to it runs as `ip netns exec NS python
client.py ...` and prints one JSON document:

    client.py wait URL MODEL DEADLINE_S     until /v1/models lists MODEL and a completion
                                           answers 200 (exit 1 at the deadline)
    client.py get URL                      one GET: status and body
    client.py post URL BODY_JSON           one non-streamed POST: status and body
    client.py stream URL BODY_JSON [--act-at N --signal SIG --targets JSON --by header|nvext]
        stream BODY to URL; once N tokens (content chunks) have arrived, send SIG to the pid
        that serves the stream: `--by header` reads the proxy's x-ftctl-worker header,
        `--by nvext` the chunks' nvext.worker_id (decode_worker_id, as a hex instance id);
        `--targets` maps either to a pid. Prints what the client saw: text, tokens (content
        chunks), finish reason, usage, error, the longest gap between chunks, and so on.

Standard library, dynamo_ftctl.http1 and tests/fetch.py only (run with the suite's python).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: the repo root

from dynamo_ftctl.http1 import HttpError
from tests import fetch


def wait(url: str, model: str, deadline_s: float) -> int:
    end = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < end:
        try:
            models = fetch.get(f"{url}/v1/models", timeout=5.0).json().get("data") or []
            if any(m.get("id") == model for m in models):
                resp = fetch.post(f"{url}/v1/completions", timeout=5.0, json={
                    "model": model, "prompt": "warm up", "max_tokens": 2})
                if resp.status == 200:
                    print(json.dumps({"ready": True}))
                    return 0
                last = f"{resp.status} {resp.text[:200]}"
            else:
                last = f"models: {models}"
        except (HttpError, TimeoutError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.2)  # a poll interval
    print(json.dumps({"ready": False, "last": last}))
    return 1


def get(url: str) -> int:
    resp = fetch.get(url, timeout=10)
    print(json.dumps({"status": resp.status, "body": resp.text,
                      "headers": dict(resp.headers)}))
    return 0


def post(url: str, body: dict[str, Any]) -> int:
    resp = fetch.post(url, json=body, timeout=60)
    print(json.dumps({"status": resp.status, "body": resp.text,
                      "headers": dict(resp.headers)}))
    return 0


def stream(url: str, body: dict[str, Any], act_at: int, sig: str, targets: dict[str, int],
           by: str, deadline_s: float) -> int:
    out: dict[str, Any] = {"status": None, "text": "", "tokens": 0, "finish": None,
                           "usage": None, "error": None, "done": False, "max_gap_s": 0.0,
                           "acted_on": None, "acted_at_s": None, "stall_after_act_s": None,
                           "worker_ids": [], "migrated": 0, "elapsed_s": None,
                           "timed_out": False, "headers": {}}
    began = time.monotonic()
    last_chunk: float | None = None
    acted: float | None = None
    buffer = b""
    try:
        with fetch.stream("POST", url, json=body, timeout=deadline_s) as resp:
            out["status"] = resp.status
            out["headers"] = dict(resp.headers)
            for piece in resp.iter_bytes():
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    now = time.monotonic()
                    for line in event.split(b"\n"):
                        if line.startswith(b": x-ftctl-migrated:"):
                            out["migrated"] = int(line.rsplit(b":", 1)[1])
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:]
                        if data == b"[DONE]":
                            out["done"] = True
                            continue
                        doc = json.loads(data)
                        if "error" in doc:
                            out["error"] = doc["error"]
                            continue
                        if doc.get("usage"):
                            out["usage"] = doc["usage"]
                        worker = ((doc.get("nvext") or {}).get("worker_id") or {}).get(
                            "decode_worker_id")
                        if worker is not None and f"{worker:016x}" not in out["worker_ids"]:
                            out["worker_ids"].append(f"{worker:016x}")
                        for choice in doc.get("choices") or []:
                            delta = choice.get("delta")
                            text = (delta.get("content") or "") if delta is not None else (
                                choice.get("text") or "")
                            if text:
                                out["tokens"] += 1
                                out["text"] += text
                                if last_chunk is not None:
                                    out["max_gap_s"] = max(out["max_gap_s"], now - last_chunk)
                                if acted is not None:
                                    # The longest wait for a token from the signal on:
                                    # tokens already on their way (in the proxy's or the
                                    # kernel's buffers, or read ahead) come at once after
                                    # it; the stall is the gap that follows them.
                                    since = max(acted, last_chunk or acted)
                                    out["stall_after_act_s"] = max(
                                        out["stall_after_act_s"] or 0.0, now - since)
                                last_chunk = now
                            out["finish"] = choice.get("finish_reason") or out["finish"]
                    if act_at and acted is None and out["tokens"] >= act_at:
                        key = (out["headers"].get("x-ftctl-worker", "").split(",")[-1]
                               if by == "header" else (out["worker_ids"] or [""])[-1])
                        os.kill(targets[key], getattr(signal, f"SIG{sig}"))
                        acted = time.monotonic()
                        out["acted_on"] = key
                        out["acted_at_s"] = acted - began
                        out["acted_after_tokens"] = out["tokens"]
    except TimeoutError as exc:
        out["timed_out"] = True
        out["error"] = out["error"] or repr(exc)
    except HttpError as exc:
        out["error"] = out["error"] or repr(exc)
    out["elapsed_s"] = time.monotonic() - began
    print(json.dumps(out))
    return 0


def main(argv: list[str]) -> int:
    command = argv[0]
    if command == "wait":
        return wait(argv[1], argv[2], float(argv[3]))
    if command == "get":
        return get(argv[1])
    if command == "post":
        return post(argv[1], json.loads(argv[2]))
    options = dict(zip(argv[3::2], argv[4::2], strict=True))
    return stream(argv[1], json.loads(argv[2]), int(options.get("--act-at", 0)),
                  options.get("--signal", "KILL"), json.loads(options.get("--targets", "{}")),
                  options.get("--by", "header"), float(options.get("--deadline", 60)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
