"""The Litestar app: health and readiness, the error mapper, and the lifespan owning resources.

`create_app(state, routes, start)` builds the app around a `ServerState`. The lifespan
starts `start(state)` (the startup phases) as a task without waiting for it, so the port
is bound and `/health` answers while the model loads; `/ready` turns 200 once the phases
are done. On shutdown it marks the state draining, runs the routes' `on_shutdown` hooks,
stops the engine (on a thread: it joins the engine loop) and closes the Redis client.

Route modules add handlers through `routes` and guard them with `ready_guard`, which
answers 503 while starting or stopping. Request bodies are msgspec Structs: unknown fields
are ignored (clients send new ones), decoding errors become 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Annotated, Any

from litestar import Litestar, Request, Response, get
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.params import Parameter
from litestar.types import ControllerRouterHandler

from api.auth import auth_guard
from api.body_limit import body_limit
from api.errors import handle_exception
from api.metrics import http_metrics, metrics
from api.registration import recorder
from api.schemas import ErrorObject, ReadyBody
from api.state import ServerState

log = logging.getLogger("longctx.serve")


def server_state(request: Request[Any, Any, Any]) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def ready_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """A Litestar guard: 503 `not_ready` until the server is ready, and again while it stops."""
    connection.app.state.server.require_ready()


@get("/health", sync_to_thread=False)
def health() -> dict[str, str]:
    """Liveness: the process answers (from the moment the port is bound)."""
    return {"status": "ok"}


MAX_WAIT_COMPILED_S = 900.0
COMPILED_POLL_S = 0.05


async def _compiled(state: ServerState, compiled: threading.Event, timeout_s: float) -> None:
    """Until `compiled` is set, `timeout_s` passes or the server begins to stop (holding no
    thread: the event is set by the engine client's reader thread)."""
    deadline = time.monotonic() + timeout_s
    while not compiled.is_set() and not state.draining and time.monotonic() < deadline:
        await asyncio.sleep(COMPILED_POLL_S)


@get("/ready", responses={503: ResponseSpec(ReadyBody, description="not ready: the phase")})
async def ready(
    request: Request[Any, Any, Any], wait_compiled_s: Annotated[float, Parameter(ge=0, le=MAX_WAIT_COMPILED_S)] = 0.0
) -> Response[ReadyBody]:
    """Readiness: 200 once the model is loaded and warmed up; 503 with the phase before and while stopping.

    The compiled step's buckets compile in the background after that: `compiled_buckets`,
    `eager_buckets` and `compiling_buckets` say where each stands. `?wait_compiled_s=S` (on a
    ready server) first waits up to S seconds until no bucket is compiling."""
    state = server_state(request)
    engine = state.engine
    if wait_compiled_s and state.ready and engine is not None:
        await _compiled(state, engine.compiled, wait_compiled_s)
    if state.ready and engine is not None and not engine.alive:  # the engine process died
        err = ErrorObject(message=state.error or "the engine is not running", type="server_error")
        return Response(ReadyBody(phase="engine_stopped", error=err), status_code=503)
    if state.ready and not state.draining:
        body = ReadyBody(status="ready", phase=state.phase, phase_seconds=state.phase_seconds)
        report = state.compile_report
        if report is not None:
            body.compiled_buckets = report.compiled_buckets
            body.eager_buckets = {str(b): why for b, why in report.eager.items()}
            body.compiling_buckets = list(report.pending)
        return Response(body)
    body = ReadyBody(phase=state.phase)
    if state.error:
        body.error = ErrorObject(message=state.error, type="server_error", code="startup_failed")
    return Response(body, status_code=503)


async def shutdown(state: ServerState) -> None:
    """Release what the startup phases built, in reverse order; each step runs even if one fails."""
    for hook in reversed(state.on_shutdown):
        try:
            await hook(state)
        except Exception:
            log.exception("shutdown hook %s failed", getattr(hook, "__qualname__", hook))
    with state.lock:
        engine, state.engine = state.engine, None
    if engine is not None:
        await asyncio.to_thread(engine.shutdown)
        log.info("engine stopped")
    if state.redis is not None:
        with contextlib.suppress(Exception):
            await state.redis.aclose()
        state.redis = None


def create_app(
    state: ServerState,
    routes: Sequence[ControllerRouterHandler] = (),
    start: Callable[[ServerState], Coroutine[Any, Any, None]] | None = None,
    debug: bool = False,
) -> Litestar:
    """The app serving `state`.

    Args:
        state: the server's state (options, phase, resources).
        routes: route handlers, routers or controllers of the API.
        start: the startup phases, run as a task once the lifespan begins (None: nothing to start).
        debug: Litestar's debug mode (tracebacks in logs).

    The largest request body is `state.options.max_body_bytes` (over: 413).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        task = asyncio.create_task(start(state), name="longctx-startup") if start is not None else None
        try:
            yield
        finally:
            state.draining, state.ready = True, False
            state.phase = "stopping"
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await shutdown(state)

    max_body_bytes = state.options.max_body_bytes
    app = Litestar(
        route_handlers=[health, ready, metrics, *routes],
        middleware=[http_metrics, body_limit(max_body_bytes), recorder(state)],
        guards=[auth_guard],  # /v1 only: the request's tenant, or 401
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        request_max_body_size=max_body_bytes,
        debug=debug,
        openapi_config=OpenAPIConfig(title="longctx", version="0.1.0"),
        logging_config=None,  # the CLI configures logging; Litestar would replace it
    )
    app.state.server = state
    return app
