"""The Responses API routes, thin over `sessions.service.SessionService`, and the session layer's
startup: the store on the server's Redis client, the service, the background workers.

    POST   /v1/responses                   create (JSON, or SSE when `stream`; Idempotency-Key)
    GET    /v1/responses/{id}              retrieve (`?stream=true&starting_after=N`: its events)
    POST   /v1/responses/{id}/cancel       cancel a background response
    DELETE /v1/responses/{id}              delete
    GET    /v1/responses/{id}/input_items  its input items (after, limit, order)
    POST   /v1/responses/compact           a context as a compaction item and the kept items
    WS     /v1/responses                   WebSocket mode: `response.create` messages (`api.ws`)

Every call runs as the request's tenant (`api.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, cast

import msgspec
from litestar import Request, Router, delete, get, post
from litestar.openapi import ResponseSpec

from api.app import ready_guard
from api.auth import tenant
from api.errors import ErrorSpec, register
from api.limits import tenant_queue
from api.metrics import METRICS, measured_events
from api.schemas import Compacted, Deleted, ErrorBody, ItemList
from api.sse import sse_response
from api.state import ServerState
from api.ws import responses_socket
from sessions.items import ItemPage
from sessions.models import Response
from sessions.requests import CreateResponseBody, InvalidParam
from sessions.service import SessionService
from sessions.store import SessionStore
from sessions.tasks import BackgroundWorkers

log = logging.getLogger("longctx.serve")

register("InvalidParam", ErrorSpec(400))
register("ContextLengthExceeded", ErrorSpec(400, code="context_length_exceeded"))
register("InvalidRequest", ErrorSpec(400))
register("NoChatTemplate", ErrorSpec(400, code="no_chat_template"))
register("RequestInProgress", ErrorSpec(409, code="request_in_progress"))


def service(request: Request[Any, Any, Any]) -> SessionService:
    """The server's session service (routes run once the server is ready: it is built)."""
    state: ServerState = request.app.state.server
    assert state.sessions is not None
    return state.sessions


ERRORS = {
    status: ResponseSpec(ErrorBody, description="an OpenAI error object")
    for status in (400, 401, 404, 409, 413, 429, 503)
}


def page_body(page: ItemPage) -> ItemList:
    return ItemList.of(page)


@post("/responses", status_code=200, responses=ERRORS)
async def create_response(request: Request[Any, Any, Any], data: CreateResponseBody) -> Response:
    """Create a response (the final one; SSE events when `stream` is true)."""
    started, who = time.perf_counter(), tenant(request)
    result = await service(request).create(who, data, request.headers.get("idempotency-key"))
    if isinstance(result, Response):
        METRICS.count_usage(who, result.usage)
        return result
    return cast(Response, sse_response(measured_events(result, who, started)))


@post("/responses/compact", status_code=200, responses=ERRORS)
async def compact_response(request: Request[Any, Any, Any], data: CreateResponseBody) -> Compacted:
    """A context as a compaction item and the items kept verbatim; writes nothing."""
    return msgspec.convert(await service(request).compact(tenant(request), data), Compacted)


@get("/responses/{resp_id:str}", responses=ERRORS)
async def retrieve_response(
    request: Request[Any, Any, Any], resp_id: str, stream: bool = False, starting_after: int | None = None
) -> Response:
    """A stored response (`?stream=true`: its events after `starting_after`, as SSE)."""
    svc = service(request)
    if stream:
        found = await svc.retrieve(tenant(request), resp_id)  # NotFound before the stream starts
        if not found.background:
            raise InvalidParam("stream", "only background responses keep their events; retrieve it without stream")
        return cast(Response, sse_response(svc.stream_events(tenant(request), resp_id, starting_after)))
    return await svc.retrieve(tenant(request), resp_id)


@post("/responses/{resp_id:str}/cancel", status_code=200, responses=ERRORS)
async def cancel_response(request: Request[Any, Any, Any], resp_id: str) -> Response:
    """Cancel a background response."""
    return await service(request).cancel(tenant(request), resp_id)


@delete("/responses/{resp_id:str}", status_code=200, responses=ERRORS)
async def delete_response(request: Request[Any, Any, Any], resp_id: str) -> Deleted:
    return msgspec.convert(await service(request).delete(tenant(request), resp_id), Deleted)


@get("/responses/{resp_id:str}/input_items", responses=ERRORS)
async def input_items(
    request: Request[Any, Any, Any], resp_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
) -> ItemList:
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
        responses_socket,
    ],
    guards=[ready_guard],
)


def stop_margin_s(grace_s: float) -> float:
    """How long before the end of the grace foreground turns are stopped, so that their
    `response.incomplete` event and commit go out before uvicorn cuts the connections."""
    return min(5.0, 0.5 * grace_s)  # ending a turn takes an engine step and a Redis commit: slow on busy cores


def image_processor(loaded: Any) -> Any:
    """A vision-language checkpoint's image processor (`engine.loading.images`); None for a text model."""
    vision = getattr(loaded.config, "vision", None)
    if vision is None:
        return None
    from engine.loading.images import ImageProcessor

    return ImageProcessor.load(loaded.source.path, vision)


def setup(state: ServerState) -> None:
    """Build the session layer once the engine is warm (the `routes` phase); stop it on shutdown.

    Shutdown (SIGTERM): background workers stop claiming at once; foreground turns still running
    shortly before the grace ends are stopped (they commit `incomplete`, reason `server_shutdown`,
    and their streams end with that event); at the lifespan's end running background jobs get
    what is left of the grace, then are aborted and handed back to the queue.
    """

    async def start(state: ServerState) -> None:
        from tools.formats import detect_format, resolve_format

        engine, redis, loaded, grammar = state.engine, state.redis, state.loaded, state.grammar
        assert engine is not None and redis is not None and loaded is not None and grammar is not None
        o = state.options
        store = SessionStore(redis, o.store)
        await store.check_server()
        await store.compaction_secret()  # made at start, so that no request writes them
        await store.reasoning_key()
        tok = loaded.tokenizer
        fmt = detect_format(tok) if o.tool_call_format == "auto" else resolve_format(o.tool_call_format)
        images = await asyncio.to_thread(image_processor, loaded)
        svc = state.sessions = SessionService(engine, store, tok, grammar, fmt, o.service, images)
        svc.waiting = tenant_queue(state)  # foreground responses count as their tenant's waiting requests
        if o.workers.workers:
            workers = state.workers = BackgroundWorkers(svc, o.workers)
            state.workers_task = asyncio.create_task(workers.run(), name="background-workers")
            state.on_drain.append(workers.stop_claiming)
        loop = asyncio.get_running_loop()

        def stop_turns() -> None:
            if state.stopping is None:  # the task is kept until the process ends
                log.info("shutdown: stopping the foreground responses still running")
                state.stopping = loop.create_task(svc.stop_foreground(5.0))

        def stop_turns_later() -> None:  # on the loop, soon after the signal
            loop.call_later(max(0.0, state.grace_left() - stop_margin_s(o.shutdown_grace_s)), stop_turns)

        def on_drain() -> None:  # in the signal handler
            loop.call_soon_threadsafe(stop_turns_later)

        state.on_drain.append(on_drain)

    async def stop(state: ServerState) -> None:
        workers, task = state.workers, state.workers_task
        state.workers = state.workers_task = None
        if workers is not None:
            workers.stop_claiming()
            await workers.drain(state.grace_left())
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if state.sessions is not None:
            stopped = await state.sessions.stop_foreground(5.0)
            if stopped:
                log.info("%d foreground responses stopped by the shutdown (incomplete)", stopped)

    state.on_startup.append(start)
    state.on_shutdown.append(stop)
