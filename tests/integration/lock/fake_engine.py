"""A tiny engine with vLLM's sleep endpoints, for `failover run` tests (run as a script).

argv: PORT [--wake-delay S] [--no-is-sleeping]. /health is 200 once up,
/sleep and /wake_up toggle `sleeping`, /v1/completions answers 503 while asleep.
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"sleeping": False, "wake_delay": 0.0, "is_sleeping": True}


class Handler(BaseHTTPRequestHandler):
    def _reply(self, code: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {"ok": True})
        elif self.path == "/is_sleeping" and STATE["is_sleeping"]:
            self._reply(200, {"is_sleeping": STATE["sleeping"]})
        else:
            self._reply(404, {})

    def do_POST(self) -> None:
        if self.path.startswith("/sleep"):
            STATE["sleeping"] = True
            self._reply(200, {})
        elif self.path == "/wake_up":
            time.sleep(float(STATE["wake_delay"]))
            STATE["sleeping"] = False
            self._reply(200, {})
        elif self.path == "/v1/completions":
            self._reply(503 if STATE["sleeping"] else 200, {"choices": [{"text": "ok"}]})
        else:
            self._reply(404, {})

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    port = int(sys.argv[1])
    if "--wake-delay" in sys.argv:
        STATE["wake_delay"] = float(sys.argv[sys.argv.index("--wake-delay") + 1])
    if "--no-is-sleeping" in sys.argv:
        STATE["is_sleeping"] = False
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
