"""A tiny engine with vLLM's sleep endpoints, for `failover run` tests (run as a script).

argv: PORT [--wake-delay S] [--no-is-sleeping] [--token-env NAME]. /health is 200 once up,
/sleep and /wake_up toggle `sleeping`, /v1/completions answers 503 while asleep. With
--token-env, /sleep and /wake_up need `Authorization: Bearer $NAME` (401 without it, 403
while NAME is unset), as `ftctl sim` does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"sleeping": False, "wake_delay": 0.0, "is_sleeping": True}
TOKEN_ENV: list[str] = []  # the variable named by --token-env, if given


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

    def _denied(self) -> bool:
        if not TOKEN_ENV:
            return False
        token = os.environ.get(TOKEN_ENV[0])
        if not token:
            self._reply(403, {"error": "no admin token"})
            return True
        if self.headers.get("Authorization") != f"Bearer {token}":
            self._reply(401, {"error": "missing or wrong bearer token"})
            return True
        return False

    def do_POST(self) -> None:
        if self.path.startswith(("/sleep", "/wake_up")) and self._denied():
            return
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
    if "--token-env" in sys.argv:
        TOKEN_ENV.append(sys.argv[sys.argv.index("--token-env") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
