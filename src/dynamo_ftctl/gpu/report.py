"""Hand GPU faults to the canary daemon: `POST /report` once per affected worker.

The body is the daemon's passive-signal format:
`{"worker": "w3", "ok": false, "reason": "xid 48: ...", "source": "gpu"}`,
with the daemon's bearer token (`Authorization: Bearer`, see `dynamo_ftctl.auth`).
Only actionable events (catalog action other than IGNORE) that name workers
are sent. A daemon that is down must not stop the watcher: failures are
counted and logged on stderr, never raised.

Sent through the blocking client of the canary probe
(`health.transport.Http1Transport`, the seam tests replace): one POST now and
then needs no pool, and it keeps httpx out of `ftctl gpu watch`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.auth import bearer_headers
from dynamo_ftctl.gpu.events import GpuEvent
from dynamo_ftctl.health.transport import Http1Transport, TransportError, post_json

if TYPE_CHECKING:
    from dynamo_ftctl.http1.transport import Transport

__all__ = ["CanaryReporter", "report_url"]


def report_url(url: str) -> str:
    """The daemon's `/report` endpoint, given its base URL or the endpoint itself."""
    base = url.rstrip("/")
    return base if base.endswith("/report") else f"{base}/report"


class CanaryReporter:
    """Posts actionable GPU events to a canary daemon."""

    def __init__(
        self, url: str, *, token: str | None = None, transport: Transport | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.url = report_url(url)
        self._headers = bearer_headers(token)
        self._transport = transport if transport is not None else Http1Transport()
        self._timeout_s = timeout_s
        self.sent = 0
        self.failures = 0

    @staticmethod
    def bodies(event: GpuEvent) -> list[dict[str, Any]]:
        """The request bodies for one event (none for IGNORE or no workers)."""
        if not event.actionable:
            return []
        return [
            {"worker": worker, "ok": False, "reason": event.reason, "source": "gpu"}
            for worker in event.workers
        ]

    def report(self, event: GpuEvent) -> int:
        """Send the event for each affected worker; the number accepted by the daemon."""
        from dynamo_ftctl.output import warn

        accepted = 0
        for body in self.bodies(event):
            try:
                reply = post_json(self._transport, self.url, json.dumps(body).encode(),
                                  timeout_s=self._timeout_s, headers=self._headers)
            except TransportError as exc:
                self.failures += 1
                warn(f"cannot report {body['worker']} to {self.url}: {exc.message}")
                continue
            if reply.status >= 400:
                self.failures += 1
                text = reply.body[:200].decode("utf-8", errors="replace")
                warn(f"{self.url} refused the report for {body['worker']}: "
                     f"HTTP {reply.status} {text}")
                continue
            accepted += 1
            self.sent += 1
        return accepted

    def close(self) -> None:
        """Nothing held between reports (one connection per POST); kept for callers."""
