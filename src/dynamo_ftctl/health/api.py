"""The canary daemon's HTTP API: `GET /workers`, `POST /report`, `GET /metrics`, `GET /health`.

`/report` needs the bearer token in `$canary.token_env` (FTCTL_DAEMON_TOKEN;
403 while it is unset, 401 without it, `dynamo_ftctl.auth`) and takes at most
`report_burst` reports at once and `report_rate_per_s` a second from one client
address (429 with Retry-After beyond). The API is a `httpapp.Router` on the
package's one HTTP server (`serve_api`), whose limits cover it: a head over
64 KiB is 431, a request not read whole within its timeout 408. It reads and
reports to a `HealthDaemon` (health/daemon.py, which re-exports these names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynamo_ftctl.auth import RateLimiter, check_bearer
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.jsoncodec import loads

if TYPE_CHECKING:
    from dynamo_ftctl.health.daemon import HealthDaemon
    from dynamo_ftctl.httpapp import Router
    from dynamo_ftctl.httpserver import Reply, Request, Server

__all__ = ["create_app", "serve_api", "split_listen"]


# A report is one small JSON object; a bigger body is refused before it is parsed.
_MAX_REPORT_BYTES = 65536


def create_app(daemon: HealthDaemon, *, token: str | None = None) -> Router:
    """The daemon's HTTP API as routes of the one server; `POST /report` needs `token`
    (None: refused)."""
    from dynamo_ftctl.httpapp import Router, json_reply, metrics_reply

    config = daemon.config
    limiter = RateLimiter(config.report_rate_per_s, config.report_burst, daemon.clock)
    unset = f"reports disabled: ${config.token_env} is not set on the canary daemon"

    async def workers(_: Request) -> Reply:
        return json_reply(daemon.snapshot())

    async def report(request: Request) -> Reply:
        authorization = request.header(b"authorization")
        denied = check_bearer(None if authorization is None else authorization.decode("latin-1"),
                              token, unset=unset)
        if denied is not None:
            return json_reply({"error": denied.message}, denied.status, denied.headers)
        # Limited after the token check: unauthenticated floods must not use up the
        # budget of a real reporter sharing the address (every local client is 127.0.0.1).
        wait_s = limiter.take(request.client[0] if request.client else "")
        if wait_s:
            return json_reply(
                {"error": f"more than {config.report_burst} reports at once or "
                          f"{config.report_rate_per_s:g}/s from this address"},
                429, {"Retry-After": limiter.retry_after(wait_s)})
        if len(request.body) > _MAX_REPORT_BYTES:
            return json_reply({"error": "report body over 64 KiB"}, 413)
        try:
            body = loads(request.body)
        except ValueError:
            return json_reply({"error": "body is not JSON"}, 400)
        if not isinstance(body, dict):
            return json_reply({"error": "body must be a JSON object"}, 400)
        try:
            outcome = daemon.report(body)
        except InvalidInput as exc:
            return json_reply({"error": str(exc)}, 400)
        return json_reply(outcome.to_json())

    async def metrics(_: Request) -> Reply:
        from dynamo_ftctl.metrics import DAEMON, registry_for

        return metrics_reply(registry_for(DAEMON))

    async def health(_: Request) -> Reply:
        return json_reply({"status": "ok", "workers": daemon.counts(),
                           "rounds": daemon.rounds, "probes": daemon.probes,
                           "set_kind": daemon.canary_set.kind})

    router = Router()
    router.get("/workers", workers)
    router.post("/report", report)
    router.get("/metrics", metrics)
    router.get("/health", health)
    return router


def split_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets or not) -> (host, port); `InvalidInput` else."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        msg = f"cannot listen on {listen}: expected HOST:PORT"
        raise InvalidInput(msg)
    return host.strip("[]"), int(port)


async def serve_api(daemon: HealthDaemon, listen: str, *, token: str | None,
                    **server_options: Any) -> Server:
    """Serve `create_app(daemon)` on `listen` (the one server's limits and timeouts;
    `server_options` go to `httpserver.start_server`). `InvalidInput` if it cannot bind."""
    from dynamo_ftctl.httpserver import start_server

    host, port = split_listen(listen)
    try:
        return await start_server(create_app(daemon, token=token), host, port,
                                  **server_options)
    except OSError as exc:
        msg = f"cannot listen on {listen}: {exc.strerror or exc}"
        raise InvalidInput(msg) from None
