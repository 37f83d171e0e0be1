"""The Responses API routes, thin over `sessions.service.SessionService`, and the session layer's
startup: the store on the server's Redis client, the service, the background workers.

    POST   /v1/responses                   create (JSON, or SSE when `stream`; Idempotency-Key)
    GET    /v1/responses/{id}              retrieve (`?stream=true&starting_after=N`: its events)
    POST   /v1/responses/{id}/cancel       cancel a background response
    DELETE /v1/responses/{id}              delete
    GET    /v1/responses/{id}/input_items  its input items (after, limit, order)
    POST   /v1/responses/compact           a context as a compaction item and the kept items

Every call runs as the request's tenant (`api.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from litestar import Request, Router, delete, get, post

from api.app import ready_guard
from api.auth import tenant
from api.errors import ErrorSpec, register
from api.sse import sse_response
from api.state import ServerState
from sessions.config import ServiceConfig, StoreConfig
from sessions.items import ItemPage
from sessions.service import SessionService
from sessions.store import SessionStore
from sessions.tasks import BackgroundWorkers

register("InvalidParam", ErrorSpec(400))
register("ContextLengthExceeded", ErrorSpec(400, code="context_length_exceeded"))
register("InvalidRequest", ErrorSpec(400))
register("RequestInProgress", ErrorSpec(409, code="request_in_progress"))


def service(request: Request[Any, Any, Any]) -> SessionService:
    svc: SessionService = request.app.state.server.extras["sessions"]
    return svc


def page_body(page: ItemPage) -> dict[str, Any]:
    return {"object": "list", "data": page.items, "first_id": page.first_id, "last_id": page.last_id,
            "has_more": page.has_more}  # fmt: skip


@post("/responses", status_code=200)
async def create_response(request: Request[Any, Any, Any]) -> Any:
    result = await service(request).create(
        tenant(request), await request.body(), request.headers.get("idempotency-key")
    )
    if hasattr(result, "__aiter__"):
        return sse_response(result)
    return result


@post("/responses/compact", status_code=200)
async def compact_response(request: Request[Any, Any, Any]) -> Any:
    return await service(request).compact(tenant(request), await request.body())


@get("/responses/{resp_id:str}")
async def retrieve_response(
    request: Request[Any, Any, Any], resp_id: str, stream: bool = False, starting_after: int | None = None
) -> Any:
    svc = service(request)
    if stream:
        await svc.retrieve(tenant(request), resp_id)  # NotFound before the stream starts
        return sse_response(svc.stream_events(tenant(request), resp_id, starting_after))
    return await svc.retrieve(tenant(request), resp_id)


@post("/responses/{resp_id:str}/cancel", status_code=200)
async def cancel_response(request: Request[Any, Any, Any], resp_id: str) -> Any:
    return await service(request).cancel(tenant(request), resp_id)


@delete("/responses/{resp_id:str}", status_code=200)
async def delete_response(request: Request[Any, Any, Any], resp_id: str) -> dict[str, Any]:
    return await service(request).delete(tenant(request), resp_id)


@get("/responses/{resp_id:str}/input_items")
async def input_items(
    request: Request[Any, Any, Any], resp_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
) -> dict[str, Any]:
    return page_body(await service(request).input_items(tenant(request), resp_id, after, limit, order))


router = Router(
    path="/v1",
    route_handlers=[
        create_response,
        compact_response,
        retrieve_response,
        cancel_response,
        delete_response,
        input_items,
    ],
    guards=[ready_guard],
)


def setup(state: ServerState) -> None:
    """Build the session layer once the engine is warm (the `routes` phase); stop it on shutdown."""

    async def start(state: ServerState) -> None:
        from tools.formats import detect_format, resolve_format

        assert state.engine is not None and state.redis is not None and state.loaded is not None
        o = state.options
        store = SessionStore(state.redis, StoreConfig(prefix=o.redis_prefix, state_ttl_s=o.state_ttl_s))
        await store.check_server()
        tok = state.loaded.tokenizer
        fmt = detect_format(tok) if o.tool_call_format == "auto" else resolve_format(o.tool_call_format)
        name = o.served_model_name or state.loaded.source.name
        config = ServiceConfig(model=name, max_output_tokens=o.max_output_tokens)
        svc = state.extras["sessions"] = SessionService(state.engine, store, tok, state.grammar, fmt, config)
        if o.background_workers:
            workers = BackgroundWorkers(svc, o.background_workers)
            state.extras["workers"] = asyncio.create_task(workers.run(), name="background-workers")

    async def stop(state: ServerState) -> None:
        task = state.extras.pop("workers", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    state.on_startup.append(start)
    state.on_shutdown.append(stop)
