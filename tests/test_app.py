"""The app in process (no model, no Redis): readiness, the one error mapper, SSE.

Test routes stand in for the API's: one decodes a msgspec body, one raises the real domain
exceptions of the engine, tools and sessions layers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
from litestar import get, post
from litestar.params import FromPath, JSONBody
from litestar.response import Stream
from litestar.testing import TestClient

from api.app import create_app
from api.sse import COMMENT, encode_event, sse_bytes, sse_response
from api.state import ServeOptions, ServerState
from engine.request import ContextTooLong, EngineOverloaded
from sessions.errors import ConversationBusy, NotFound, StoreUnavailable
from sessions.items import InvalidItem
from tools.schema import InvalidSchema


class Format(msgspec.Struct):
    type: str
    strict: bool = False


class Body(msgspec.Struct):
    model: str
    max_output_tokens: int = 16
    text: Format | None = None


RAISE: dict[str, Exception] = {
    "context": ContextTooLong(5000, 4096, "model's context"),
    "overloaded": EngineOverloaded(256, 256, retry_after_s=2.0),
    "busy": ConversationBusy("conv_1", "resp_1"),
    "store": StoreUnavailable("Redis did not answer"),
    "missing": NotFound("conversation", "conv_2"),
    "item": InvalidItem("unknown item type 'image'", "input[2].type"),
    "schema": InvalidSchema("tool 'get_weather'", "$.properties.city", "bad type"),
    "bug": KeyError("oops"),
}


@post("/t/body", sync_to_thread=False)
def body_route(data: JSONBody[Body]) -> dict[str, Any]:
    return {"model": data.model, "max_output_tokens": data.max_output_tokens}


@get("/t/raise/{what:str}", sync_to_thread=False)
def raise_route(what: FromPath[str]) -> None:
    raise RAISE[what]


async def _events(n: int, delay_s: float = 0.0) -> AsyncIterator[dict[str, Any]]:
    for i in range(n):
        await asyncio.sleep(delay_s)
        yield {"type": "response.output_text.delta", "sequence_number": i, "delta": f"t{i}"}


@get("/t/sse", sync_to_thread=False)
def sse_route() -> Stream:
    return sse_response(_events(3, delay_s=0.3), keepalive_s=0.1)


@pytest.fixture(scope="module")
def state() -> ServerState:
    return ServerState(ServeOptions(redis_url="redis://127.0.0.1:1/0"))


@pytest.fixture(scope="module")
def client(state: ServerState) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(state, [body_route, raise_route, sse_route])) as c:
        yield c


def _error(r: Any) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_ready_says_the_phase_until_ready(client: TestClient[Any], state: ServerState) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    state.phase = "model"
    r = client.get("/ready")
    assert r.status_code == 503 and r.json() == {"phase": "model"}
    state.phase, state.ready = "ready", True
    assert client.get("/ready").status_code == 200
    state.draining = True
    assert client.get("/ready").status_code == 503
    state.draining = state.ready = False


def test_body_decoding_errors_name_the_field(client: TestClient[Any]) -> None:
    ok = client.post("/t/body", content=b'{"model": "m", "unknown_field": [1], "text": {"type": "x", "new": 1}}')
    assert ok.status_code == 201 and ok.json() == {"model": "m", "max_output_tokens": 16}

    r = client.post("/t/body", content=b'{"model": "m", "max_output_tokens": "many"}')
    err = _error(r)
    assert r.status_code == 400 and err["param"] == "max_output_tokens" and "Expected `int`" in err["message"]
    assert err["type"] == "invalid_request_error"

    r = client.post("/t/body", content=b'{"model": "m", "text": {"type": "x", "strict": "yes"}}')
    assert r.status_code == 400 and _error(r)["param"] == "text.strict"

    r = client.post("/t/body", content=b'{"max_output_tokens": 3}')
    assert r.status_code == 400 and "model" in _error(r)["message"]

    for bad in (b"{not json", b'{"model": "m",', b""):
        r = client.post("/t/body", content=bad, headers={"Content-Type": "application/json"})
        err = _error(r)
        assert r.status_code == 400 and err["param"] is None and err["code"] == "invalid_json", (bad, err)


def test_unknown_route_and_method(client: TestClient[Any]) -> None:
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and _error(r)["code"] == "not_found"
    r = client.delete("/health")
    assert r.status_code == 405 and "DELETE" in _error(r)["message"]


@pytest.mark.parametrize(
    ("what", "status", "code", "param", "headers"),
    [
        ("context", 400, "context_length_exceeded", None, {}),
        ("overloaded", 429, "engine_overloaded", None, {"retry-after": "2", "x-should-retry": "true"}),
        ("busy", 409, "conversation_busy", None, {"x-should-retry": "false"}),
        ("store", 503, "store_unavailable", None, {}),
        ("missing", 404, "not_found", None, {}),
        ("item", 400, "invalid_item", "input[2].type", {}),
        ("schema", 400, "invalid_schema", "tool 'get_weather'", {}),
        ("bug", 500, "internal_error", None, {}),
    ],
)
def test_domain_errors_map_by_class(
    client: TestClient[Any], what: str, status: int, code: str, param: str | None, headers: dict[str, str]
) -> None:
    r = client.get(f"/t/raise/{what}")
    err = _error(r)
    assert (r.status_code, err["code"], err["param"]) == (status, code, param)
    for k, v in headers.items():
        assert r.headers.get(k) == v
    if what == "bug":
        assert "oops" not in err["message"] and err["type"] == "server_error"
    else:
        assert err["message"] == str(RAISE[what])


def test_sse_events_and_keepalive_comments(client: TestClient[Any]) -> None:
    r = client.get("/t/sse")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.content.split(b"\n\n") if b]
    events = [b for b in blocks if not b.startswith(b":")]
    assert len(blocks) > len(events), "no keep-alive comment during a 0.3 s wait with keepalive_s=0.1"
    assert [e.splitlines()[0] for e in events] == [b"event: response.output_text.delta"] * 3
    data = [msgspec.json.decode(e.splitlines()[1].removeprefix(b"data: ")) for e in events]
    assert [d["sequence_number"] for d in data] == [0, 1, 2]


def test_sse_close_reaches_the_source() -> None:
    closed: list[bool] = []

    async def source() -> AsyncIterator[dict[str, str]]:
        try:
            yield {"type": "a"}
            await asyncio.sleep(60)  # a long prefill the client stops waiting for
            yield {"type": "b"}
        finally:
            closed.append(True)

    async def run() -> list[bytes]:
        out = []
        stream = sse_bytes(source(), keepalive_s=0.05)
        assert isinstance(stream, AsyncGenerator)
        async for chunk in stream:
            out.append(chunk)
            if len(out) == 3:
                break
        await stream.aclose()  # what the server does when the client disconnects
        return out

    out = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert out[0] == encode_event({"type": "a"}) and out[1:] == [COMMENT, COMMENT]
    assert closed == [True]


def test_sse_event_needs_a_type() -> None:
    with pytest.raises(ValueError):
        encode_event({"sequence_number": 1})
