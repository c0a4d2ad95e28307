"""etcd failover lock for engines on different nodes, through etcd's v3 JSON gateway.

Acquire: grant a lease with a TTL, then one transaction "if the key's
create_revision is 0 (absent), put it with the lease". The fencing token is
the key's create revision, which etcd never reuses. Waiters watch the key from
the revision their transaction saw and retry when it is deleted.

Holding: a keep-alive thread renews the lease every TTL/3. A watchdog thread
declares the lease lost at `send time of the last successful renewal + TTL -
margin`: etcd can only expire it at `receipt time + TTL`, which is later, so
the holder is told (`on_lost` callback, `LeaseLost` from `ensure_held`) before
any other engine can be given the key and a new token. After each renewal the
keep-alive thread also reads the key: deleted (`etcdctl del`), created anew or
put without our lease, the lock is no longer ours (a waiter may hold it
already, with a higher revision as its token) and the holder is told within
TTL/3. Tokens need no floor: etcd never reuses a revision.

The gateway speaks protobuf-JSON: keys and values are base64, 64-bit numbers
are strings and zero values (`succeeded: false`, `create_revision: 0`) are
omitted. HTTP goes through `dynamo_ftctl.http1` (its client imported on first
request, so `ftctl lock` with flock never loads it): the JSON calls as one
blocking exchange each through a `http1.Transport` (a `BlockingClient`, or the
`MockTransport` tests cut to make a partition), the watch as a stream on a
private event loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import InvalidInput, LockTimeout, Unreachable
from dynamo_ftctl.http1.transport import Request, Transport
from dynamo_ftctl.jsoncodec import loads
from dynamo_ftctl.lock.protocol import (
    Lease,
    LeaseLost,
    LockStatus,
    OwnerInfo,
    record_acquired,
    record_released,
)

__all__ = ["EtcdLock"]

BACKEND = "etcd"

_JSON_HEADERS = {"Content-Type": "application/json"}


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


class EtcdLock:
    """The etcd backend of `FailoverLock`.

    `on_lost` is called (from a helper thread) with a `LeaseLost` when the lease
    can no longer be trusted; the holder must stop serving at once. `transport`
    carries the JSON calls (None: an `http1.BlockingClient`, made on the first);
    its failures are `OSError`s, and each sends the call to the next endpoint.
    """

    def __init__(
        self, endpoints: Sequence[str], key: str, engine_id: int = 0, *, ttl_s: float = 5.0,
        on_lost: Callable[[LeaseLost], None] | None = None, clock: Clock = SYSTEM_CLOCK,
        transport: Transport | None = None, request_timeout_s: float = 2.0,
        metrics: bool = False,
    ) -> None:
        if not endpoints:
            msg = "etcd lock: at least one endpoint is needed"
            raise InvalidInput(msg)
        if ttl_s < 1:
            msg = f"etcd lock: ttl {ttl_s:g} s is below etcd's 1 s granularity"
            raise InvalidInput(msg)
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._key = key
        self._engine_id = engine_id
        self._ttl = max(1, round(ttl_s))
        self._on_lost = on_lost
        self._clock = clock
        self._metrics = metrics
        self._timeout = request_timeout_s
        self._transport = transport
        # Declare the lease lost this long before etcd could expire it.
        self._margin = min(0.5, self._ttl / 10)
        self._cond = threading.Condition()
        self._lease: Lease | None = None
        self._lease_id: str | None = None
        self._expires = 0.0
        self._lost: LeaseLost | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- plumbing ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._key

    @property
    def is_held(self) -> bool:
        """Held, and its last confirmed renewal still covers now (see `ensure_held`)."""
        try:
            self.ensure_held()
        except LeaseLost:
            return False
        return True

    @property
    def lost(self) -> LeaseLost | None:
        """The loss, once the lease could no longer be trusted."""
        with self._cond:
            return self._lost

    def set_on_lost(self, callback: Callable[[LeaseLost], None] | None) -> None:
        """Replace the callback told (from a helper thread) that the lease was lost."""
        self._on_lost = callback

    def ensure_held(self) -> Lease:
        """The lease, or `LeaseLost` when it was lost (call before every fenced write).

        The deadline is checked here too, not only by the watchdog thread: a holder asking
        after `last confirmed renewal + TTL - margin` is told the lease is lost even when
        a busy machine has not woken the watchdog yet.
        """
        with self._cond:
            if self._lost is not None:
                raise self._lost
            if self._lease is None:
                msg = f"etcd lock {self._key}: not held"
                raise LeaseLost(msg)
            if self._clock.now() < self._expires:
                return self._lease
        self._lose(f"no keep-alive confirmed for {self._ttl} s")
        with self._cond:
            assert self._lost is not None or self._lease is None
            raise self._lost or LeaseLost(f"etcd lock {self._key}: not held")

    def _transport_or_default(self) -> Transport:
        if self._transport is None:
            from dynamo_ftctl.http1 import BlockingClient

            self._transport = BlockingClient()
        return self._transport

    def _post(self, path: str, body: dict[str, Any],
              timeout: float | None = None) -> dict[str, Any]:
        last: Exception | None = None
        payload = json.dumps(body, separators=(",", ":")).encode()
        transport = self._transport_or_default()
        for endpoint in self._endpoints:
            request = Request("POST", f"{endpoint}{path}", payload, _JSON_HEADERS,
                              timeout or self._timeout)
            try:
                reply = transport.handle_request(request)
            except OSError as exc:  # refused, reset, timed out: the next endpoint
                last = exc
                continue
            status, raw = reply.status, reply.body
            try:
                doc = loads(raw)
            except ValueError:
                doc = {}
            if not isinstance(doc, dict):
                doc = {}
            if status != 200:
                message = (doc.get("error") or doc.get("message")
                           or raw[:200].decode("utf-8", "replace"))
                msg = f"etcd {endpoint}{path}: HTTP {status}: {message}"
                raise Unreachable(msg)
            return doc
        msg = f"etcd {', '.join(self._endpoints)}: {path}: {last or 'timed out'}"
        raise Unreachable(msg)

    def _grant(self) -> tuple[str, int]:
        doc = self._post("/v3/lease/grant", {"TTL": self._ttl})
        if doc.get("error"):
            msg = f"etcd lease grant: {doc['error']}"
            raise Unreachable(msg)
        return str(doc["ID"]), int(doc.get("TTL", self._ttl))

    def _revoke(self, lease_id: str) -> None:
        with contextlib.suppress(Unreachable):
            self._post("/v3/lease/revoke", {"ID": lease_id})

    def _owner_value(self, acquired_at: float) -> str:
        return json.dumps({
            "engine_id": self._engine_id, "pid": os.getpid(), "host": socket.gethostname(),
            "acquired_at": acquired_at,
        }, separators=(",", ":"))

    def _try_once(self) -> tuple[Lease | None, int]:
        """One grant + transaction; (lease, revision seen). Lease is None when taken."""
        sent = self._clock.now()
        lease_id, granted_ttl = self._grant()
        acquired_at = self._clock.wall()
        key = _b64(self._key)
        doc = self._post("/v3/kv/txn", {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": key, "value": _b64(self._owner_value(acquired_at)),
                                         "lease": lease_id}}],
            "failure": [{"request_range": {"key": key}}],
        })
        revision = int(doc.get("header", {}).get("revision", 0))
        if not doc.get("succeeded"):
            self._revoke(lease_id)
            return None, revision
        lease = Lease(lock=self._key, backend=BACKEND, engine_id=self._engine_id,
                      token=revision, acquired_at=acquired_at, waited_s=0.0)
        with self._cond:
            self._lease_id = lease_id
            self._expires = sent + granted_ttl - self._margin
            self._lost = None
        return lease, revision

    def _wait_deleted(self, after_revision: int, timeout: float | None) -> None:
        """Return when the key is deleted after `after_revision`, or when `timeout` passes."""
        body = json.dumps({"create_request": {
            "key": _b64(self._key), "start_revision": str(after_revision)}}).encode()
        deadline = None if timeout is None else self._clock.now() + timeout
        for endpoint in self._endpoints:
            read = None if deadline is None else max(0.01, deadline - self._clock.now())
            try:
                asyncio.run(self._watch(f"{endpoint}/v3/watch", body, read, deadline))
            except TimeoutError:
                # No event before the deadline; before it, the connection timed out.
                if deadline is not None and self._clock.now() >= deadline:
                    return
                continue
            except OSError:  # refused, reset, not HTTP: the next endpoint
                continue
            return
        msg = f"etcd {', '.join(self._endpoints)}: watch failed"
        raise Unreachable(msg)

    async def _watch(self, url: str, body: bytes, read: float | None,
                     deadline: float | None) -> None:
        """Read the watch stream (one JSON document a line) until a DELETE or the deadline."""
        from dynamo_ftctl.http1 import Client

        client = Client()
        try:
            response = await client.request("POST", url, body, _JSON_HEADERS,
                                            connect_timeout_s=self._timeout,
                                            head_timeout_s=read)
            async with response:
                pending = b""
                while piece := await response.next_chunk(read):
                    *lines, pending = (pending + piece).split(b"\n")
                    for line in lines:
                        if not line.strip():
                            continue
                        result = loads(line).get("result", {})
                        if result.get("canceled") or any(
                            event.get("type") == "DELETE" for event in result.get("events", ())
                        ):
                            return
                        if deadline is not None and self._clock.now() >= deadline:
                            return
        finally:
            await client.close()

    # -- holding ----------------------------------------------------------------------

    def _lose(self, reason: str) -> None:
        with self._cond:
            if self._lost is not None or self._lease is None:
                return
            self._lost = LeaseLost(f"etcd lock {self._key}: lost the lock ({reason})")
            lost = self._lost
            self._cond.notify_all()
        if self._metrics:
            record_released(self._key, self._engine_id)
        if self._on_lost is not None:
            self._on_lost(lost)

    def _keep_alive(self, lease_id: str) -> None:
        interval = self._ttl / 3
        while not self._stop.wait(interval):
            sent = self._clock.now()
            try:
                doc = self._post("/v3/lease/keepalive", {"ID": lease_id}, timeout=interval)
            except Unreachable:
                continue  # the watchdog decides when it is too late
            ttl = int(doc.get("result", {}).get("TTL", 0))
            if ttl <= 0:
                self._lose("etcd says the lease expired")
                return
            with self._cond:
                self._expires = max(self._expires, sent + ttl - self._margin)
                self._cond.notify_all()
            try:
                taken = self._key_taken(lease_id)
            except Unreachable:
                continue  # as for a failed renewal: the watchdog decides
            if taken is not None:
                self._lose(taken)
                return

    def _key_taken(self, lease_id: str) -> str | None:
        """Why the key is no longer the one this lease created, or None while it is."""
        with self._cond:
            lease = self._lease
        if lease is None:
            return None  # released meanwhile
        kvs = self._post("/v3/kv/range", {"key": _b64(self._key)}).get("kvs") or []
        if not kvs:
            return "the key was deleted"
        created = int(kvs[0].get("create_revision", 0))
        if created != lease.token:
            return f"the key was created anew (revision {created})"
        if int(kvs[0].get("lease", 0)) != int(lease_id):
            return "the key was put without this lease"
        return None

    def _watchdog(self) -> None:
        with self._cond:
            while not self._stop.is_set() and self._lost is None:
                remaining = self._expires - self._clock.now()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            expired = not self._stop.is_set() and self._lost is None
        if expired:
            self._lose(f"no keep-alive confirmed for {self._ttl} s")

    def _start_holding(self, lease_id: str) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._keep_alive, args=(lease_id,),
                             name="ftctl-etcd-keepalive", daemon=True),
            threading.Thread(target=self._watchdog, name="ftctl-etcd-watchdog", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- FailoverLock -----------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> Lease:
        """Block (at most `timeout` s) until the key is ours; `LockTimeout` otherwise."""
        if self._lease is not None:
            msg = f"etcd lock {self._key}: already held by this object"
            raise InvalidInput(msg)
        started = self._clock.now()
        while True:
            lease, revision = self._try_once()
            if lease is not None:
                waited = self._clock.now() - started
                lease = Lease(lock=lease.lock, backend=BACKEND, engine_id=lease.engine_id,
                              token=lease.token, acquired_at=lease.acquired_at, waited_s=waited)
                with self._cond:
                    self._lease = lease
                assert self._lease_id is not None
                self._start_holding(self._lease_id)
                if self._metrics:
                    record_acquired(lease)
                return lease
            remaining = None if timeout is None else timeout - (self._clock.now() - started)
            if remaining is not None and remaining <= 0:
                holder = self.owner()
                who = f" (held by engine {holder.engine_id}, pid {holder.pid})" if holder else ""
                msg = f"etcd lock {self._key}: not acquired within {timeout:g} s{who}"
                raise LockTimeout(msg)
            self._wait_deleted(revision + 1, remaining)

    async def aacquire(self, timeout: float | None = None) -> Lease:
        """`acquire` in a daemon thread; a cancelled task never keeps the lock.

        Not `asyncio.to_thread`: `asyncio.run` joins its executor at exit, and a
        waiter watching the key forever would keep the process from exiting.
        """
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[Lease] = loop.create_future()
        abandoned = threading.Event()

        def settle(lease: Lease | None, error: BaseException | None) -> None:
            if landed.done():
                return
            if error is not None:
                landed.set_exception(error)
            else:
                assert lease is not None
                landed.set_result(lease)

        def work() -> None:
            try:
                lease = self.acquire(timeout)
            except BaseException as exc:  # handed to the awaiting task
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle, None, exc)
                return
            if abandoned.is_set():
                self.release()
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, lease, None)

        threading.Thread(target=work, name="ftctl-etcd-acquire", daemon=True).start()
        try:
            return await landed
        except asyncio.CancelledError:
            abandoned.set()
            if landed.done() and not landed.cancelled() and landed.exception() is None:
                self.release()
            raise

    def release(self) -> None:
        """Stop the keep-alive and revoke the lease (which deletes the key)."""
        with self._cond:
            lease, self._lease = self._lease, None
            lease_id, self._lease_id = self._lease_id, None
            self._stop.set()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=self._timeout * 2)
        self._threads = []
        if lease_id is not None:
            self._revoke(lease_id)
        if lease is not None and self._metrics:
            record_released(self._key, self._engine_id)

    def close(self) -> None:
        """Release (no connection outlives a request)."""
        self.release()

    def owner(self) -> OwnerInfo | None:
        doc = self._post("/v3/kv/range", {"key": _b64(self._key)})
        kvs = doc.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        try:
            data = loads(_unb64(kv.get("value", "")).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        acquired = data.get("acquired_at")
        return OwnerInfo(
            lock=self._key, backend=BACKEND, live=True,
            engine_id=data.get("engine_id") if isinstance(data.get("engine_id"), int) else None,
            pid=data.get("pid") if isinstance(data.get("pid"), int) else None,
            host=data.get("host") if isinstance(data.get("host"), str) else None,
            acquired_at=float(acquired) if isinstance(acquired, int | float) else None,
            token=int(kv.get("create_revision", 0)) or None,
        )

    def status(self) -> LockStatus:
        """Held or free, with the owner data (a key exists only while its lease lives)."""
        owner = self.owner()
        return LockStatus(lock=self._key, backend=BACKEND, held=owner is not None, owner=owner)
