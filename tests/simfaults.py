"""What a test asks a running `ftctl sim` worker about its faults."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests import fetch

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker


def hung(worker: SimWorker) -> bool:
    """The worker's hang fault has begun (it starts a moment after the admin call)."""
    resp = fetch.get(f"{worker.url}/admin/fault",
                     headers={"Authorization": f"Bearer {worker.admin_token}"})
    return bool(resp.json()["hung"])


def health_stalls(url: str, timeout_s: float = 0.5) -> bool:
    """GET /health of `url` has no answer within `timeout_s` (a hung worker)."""
    try:
        fetch.get(f"{url}/health", timeout=timeout_s)
    except TimeoutError:
        return True
    return False
