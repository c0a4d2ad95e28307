"""`migrate_request` against workers without the admin KV API (vLLM), served on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from rich.console import Console

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.http1 import Client
from dynamo_ftctl.httpapp import json_reply, text_reply
from dynamo_ftctl.httpserver import Reply, Request, start_server
from dynamo_ftctl.kv.wire import KvHeader, KvLayout, encode_kv
from dynamo_ftctl.migrate.calibrate import Calibration, PrefillFit, TransferFit
from dynamo_ftctl.migrate.transfer import (
    Endpoint,
    KvApiMissing,
    MigrationResult,
    migrate_request,
)

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
PROMPT, GENERATED = (5, 6, 7, 8, 9), (20, 21)
SAMPLING = {"seed": 7, "max_tokens": 6, "temperature": 0.8, "top_p": 1.0}
SOURCE = Endpoint(name="sim", url="http://sim", admin_url="http://sim", token="t")
TARGET = Endpoint(name="vllm", url="http://vllm", admin_url="http://vllm")
CONTINUATION = (30, 31, 32, 33)
# Route-missing answers as real servers give them: vLLM's router, a 405, a 501.
VLLM_404 = (404, {"error": {"message": "Not Found", "type": "Not Found", "code": 404}})
NO_ROUTE = [VLLM_404, (405, {"detail": "Method Not Allowed"}), (501, {"detail": "nope"})]


def export_payload() -> bytes:
    """A sim-style KV export of one request: 5 prompt + 2 generated tokens."""
    ids = PROMPT + GENERATED
    header = KvHeader(layout=LAYOUT, model="ftctl-sim-tiny", request_id="r1", token_ids=ids,
                      prompt_len=len(PROMPT), num_tokens=len(ids) - 1, sampling=SAMPLING)
    return encode_kv(header, [bytes(LAYOUT.block_bytes)] * header.num_blocks)


def sse(ids: tuple[int, ...]) -> bytes:
    """A streamed completion of `ids`, one token an event, vLLM's shape."""
    events = [{"choices": [{"index": 0, "text": f"<{t}>", "token_ids": [t],
                            "finish_reason": "length" if i == len(ids) - 1 else None}]}
              for i, t in enumerate(ids)]
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


class Workers:
    """A sim source and a target, each a loopback server, recording what each was asked.

    Calls are recorded as (method, URL) with the worker's name as host
    (`http://vllm/admin/kv/import`), whatever port its server has.
    """

    def __init__(self, *, export: tuple[int, Any] | None = None,
                 kv_import: tuple[int, Any] = VLLM_404) -> None:
        self.export, self.kv_import = export, kv_import
        self.calls: list[tuple[str, str]] = []
        self.reprefill: dict[str, Any] | None = None

    def handler(self, host: str) -> Callable[[Request], Awaitable[Reply]]:
        """The server of worker `host` ("sim" or "vllm")."""

        async def answer(request: Request) -> Reply:
            path = request.path
            self.calls.append((request.method, f"http://{host}{path}"))
            if host == "sim" and path == "/admin/kv/r1":
                if self.export is not None:
                    return json_reply(self.export[1], self.export[0])
                return Reply(200, export_payload(), "application/octet-stream")
            if host == "vllm" and path == "/admin/kv/import":
                code, body = self.kv_import
                return json_reply(body, code)
            if host == "vllm" and path == "/v1/completions":
                self.reprefill = json.loads(request.body)
                return text_reply(sse(CONTINUATION), content_type="text/event-stream")
            return json_reply({"detail": "Not Found"}, 404)

        return answer


def _on(endpoint: Endpoint, address: str) -> Endpoint:
    """`endpoint` at `address` (a server's URL); an empty admin URL stays empty."""
    return dataclasses.replace(endpoint, url=address,
                               admin_url=address if endpoint.admin_url else "")


def move(workers: Workers, method: str = "kv", target: Endpoint = TARGET,
         calibration: Calibration | None = None) -> MigrationResult:
    async def run() -> MigrationResult:
        servers = [await start_server(workers.handler(host), "127.0.0.1", 0)
                   for host in ("sim", "vllm")]
        client = Client()
        try:
            return await migrate_request(
                client, _on(SOURCE, servers[0].address), _on(target, servers[1].address), "r1",
                method=method, calibration=calibration, timeout_s=10.0)
        finally:
            await client.close()
            for server in servers:
                await server.shutdown(2.0)

    return asyncio.run(run())


@pytest.mark.parametrize(("code", "body"), NO_ROUTE)
def test_kv_to_a_target_without_import_api_falls_back_to_reprefill(code: int, body: Any) -> None:
    """A target answering 404/405/501 on /admin/kv/import gets the request by re-prefill."""
    workers = Workers(kv_import=(code, body))
    result = move(workers)
    assert result.requested == "kv"
    assert result.method == "reprefill"
    assert result.fallback is not None
    assert f"vllm: no KV import API (POST /admin/kv/import answered HTTP {code})" in result.fallback
    assert "re-prefilled instead of kv" in result.fallback
    assert result.continuation == CONTINUATION
    assert result.output_token_ids == GENERATED + CONTINUATION
    assert workers.reprefill is not None
    assert workers.reprefill["prompt"] == list(PROMPT + GENERATED)
    assert workers.reprefill["max_tokens"] == SAMPLING["max_tokens"] - len(GENERATED)
    assert workers.reprefill["seed"] == SAMPLING["seed"]


def test_target_without_admin_url_falls_back_without_trying_import() -> None:
    """A target with no admin URL is re-prefilled at once; no import is attempted."""
    workers = Workers()
    result = move(workers, target=Endpoint(name="vllm", url="http://vllm", admin_url=""))
    assert result.method == "reprefill"
    assert result.fallback == "vllm: no KV import API (no admin URL): re-prefilled instead of kv"
    assert ("POST", "http://vllm/admin/kv/import") not in workers.calls


def test_auto_choosing_kv_falls_back_too() -> None:
    """--method auto whose plan says kv falls back to re-prefill on a target without import."""
    calibration = Calibration(
        worker="sim", peer="vllm", model="ftctl-sim-tiny", layers=2, kv_heads=2, head_dim=4,
        dtype_bytes=4, block_size=4,
        prefill=PrefillFit(fixed_s=10.0, per_token_s=1.0),  # re-prefill priced far above kv
        transfer=TransferFit(setup_s=0.0, bandwidth_bytes_per_s=1e12),
    )
    result = move(Workers(), method="auto", calibration=calibration)
    assert result.plan is not None
    assert result.plan.decision == "kv"
    assert result.method == "reprefill"
    assert result.fallback is not None


def test_fallback_is_shown_in_the_table_and_the_json() -> None:
    """The fallback note is a row of the table and a field of --json."""
    result = move(Workers())
    assert result.to_json()["fallback"] == result.fallback
    console = Console(record=True, width=200)
    console.print(result)
    assert "no KV import API" in console.export_text()
    plain = move(Workers(), method="reprefill")
    assert plain.fallback is None
    assert plain.to_json()["fallback"] is None


def test_a_real_import_refusal_is_not_a_fallback() -> None:
    """A 400 from the import API (a bad payload) is an error, not a silent re-prefill."""
    workers = Workers(kv_import=(400, {"error": {"message": "bad layout",
                                                 "type": "invalid_request_error"}}))
    with pytest.raises(InvalidInput, match=r"vllm: KV import refused \(400\): bad layout"):
        move(workers)
    assert workers.reprefill is None


@pytest.mark.parametrize(("code", "body"), NO_ROUTE)
def test_source_without_export_api_is_one_clear_error(code: int, body: Any) -> None:
    """A source with no export route: the state cannot be read there; the proxy is named."""
    workers = Workers(export=(code, body))
    with pytest.raises(KvApiMissing) as caught:
        move(workers, method="reprefill")
    message = str(caught.value)
    assert message.startswith("sim: the state of request 'r1' cannot be read from this worker")
    assert f"answered HTTP {code}" in message
    assert "`ftctl proxy` migrates requests" in message
    assert "\n" not in message
    assert caught.value.exit_code == 2
    assert [c for c in workers.calls if "vllm" in c[1]] == []


def test_unknown_request_on_a_sim_source_stays_not_found() -> None:
    """The sim's 404 NotFoundError (no such request) is not mistaken for a missing API."""
    workers = Workers(export=(404, {"error": {"message": "no request 'r1'",
                                              "type": "NotFoundError"}}))
    with pytest.raises(InvalidInput, match=r"sim: KV export of 'r1' refused \(404\)") as caught:
        move(workers)
    assert not isinstance(caught.value, KvApiMissing)
