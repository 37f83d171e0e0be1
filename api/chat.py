"""Chat Completions and Models: a Chat request is a stateless turn of the session service
(`SessionService.stateless`: no conversation, no stored items), planned, submitted and read by
the same code as a Responses turn (`sessions.generation`: output limits, grammar, tool-call
parsing, cancellation, usage). Only Chat's shapes are here: the request's checks
(`api.chat_request`) and the reply's deltas (`api.chat_reply`) in, `chat.completion` or its
chunks out.

    POST /v1/chat/completions   a reply (JSON, or `data:` chunks ending `data: [DONE]` when `stream`)
    GET  /v1/models             the served model
    GET  /v1/models/{id}        it, or 404 `model_not_found`

The engine's cache salt is the tenant. `max_tokens` (or `max_completion_tokens`) defaults to the
rest of the context. A grammar dead end (`FinishReason.ERROR`) is a 500 `grammar_dead_end`
(streamed: an error chunk), never a 200 with broken output. A client that leaves a stream aborts
its engine request. Logprobs are the model's raw distribution (before temperature, penalties and
the grammar mask).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

import msgspec
from litestar import Request, Router, get, post
from litestar.background_tasks import BackgroundTask

from api.app import ready_guard
from api.auth import tenant as request_tenant
from api.chat_reply import ChatReply, token_logprobs
from api.chat_request import ChatShape, ask_of
from api.errors import ErrorSpec, register
from api.metrics import METRICS
from api.responses import ERRORS, service
from api.schemas import ChatCompletion, ChatCompletionBody, Model, ModelList
from api.sse import HEADERS, EventStream
from engine.request import FinishReason
from sessions.errors import check_model
from sessions.generation import Generation
from sessions.ids import new_id
from sessions.models import Usage
from sessions.service import SessionService

_encoder = msgspec.json.Encoder()


class GrammarDeadEnd(RuntimeError):
    pass


register("GrammarDeadEnd", ErrorSpec(500, "server_error", "grammar_dead_end", param=lambda e: None))


def _finish(reason: FinishReason | None, reply: ChatReply) -> str:
    if reason == FinishReason.LENGTH:
        return "length"
    return "tool_calls" if reply.calls else "stop"


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.input_tokens_details.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.output_tokens_details.reasoning_tokens},
    }


def closer(gen: Generation) -> Callable[[], None]:
    """What ends a request whose reader is gone, whether or not `run` ever started: the waiting
    place is given back and an unfinished engine request aborted."""

    def close() -> None:
        gen.release()
        if gen.handle is not None and not gen.handle.done:
            gen.abort()

    return close


async def run(
    svc: SessionService, gen: Generation, shape: ChatShape, tenant: str, started: float
) -> AsyncGenerator[dict[str, Any], None]:
    """The reply as chunk bodies; the last one has `finish_reason` (and `usage`, `message`, logprobs).
    `started`: perf_counter at the HTTP request's start (time to first token)."""
    reply = ChatReply(gen.parser, gen.splitter)
    last: float | None = None
    logprobs: list[dict[str, Any]] = []
    async with contextlib.aclosing(gen.read(reply)) as outputs:
        async for out in outputs:
            if out.token_ids:
                now = time.perf_counter()
                if last is None:
                    METRICS.ttft.observe(now - started)
                else:
                    METRICS.itl.observe(now - last)
                last = now
            lps = token_logprobs(svc.tokenizer, out.logprobs, shape.top_logprobs or 0) if out.logprobs else []
            logprobs += lps
            if out.finish_reason is not None:
                reply.finish()
            deltas = reply.take()
            for i, d in enumerate(deltas):
                yield {"delta": d, "logprobs": lps if i == 0 and lps else None}
            if lps and not deltas:
                yield {"delta": {}, "logprobs": lps}
    usage = gen.usage()
    METRICS.count_usage(tenant, usage)
    if gen.reason == FinishReason.ERROR:
        raise GrammarDeadEnd(gen.error or "the grammar admits no further token")
    yield {
        "finish_reason": _finish(gen.reason, reply),
        "message": reply.message(),
        "logprobs": logprobs,
        "usage": _usage(usage),
    }


def _chunk(gen: Generation, model: str, created: int, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    body = {"id": gen.id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    return b"data: " + _encoder.encode(body | extra) + b"\n\n"


async def stream_chunks(
    svc: SessionService,
    gen: Generation,
    shape: ChatShape,
    parts: AsyncGenerator[dict[str, Any], None],
    close: Callable[[], None],
) -> AsyncIterator[bytes]:
    """The SSE body; `close` runs however it ends (a client gone before `parts` started included)."""
    model, created = svc.config.model, int(time.time())
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    try:
        yield _chunk(gen, model, created, [first])
        async for part in parts:
            if "finish_reason" in part:
                last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": part["finish_reason"]}
                yield _chunk(gen, model, created, [last])
                if shape.include_usage:
                    yield _chunk(gen, model, created, [], usage=part["usage"])
                break
            lp = {"content": part["logprobs"]} if part["logprobs"] else None
            choice = {"index": 0, "delta": part["delta"], "logprobs": lp, "finish_reason": None}
            yield _chunk(gen, model, created, [choice])
    except GrammarDeadEnd as e:
        err = {"message": str(e), "type": "server_error", "param": None, "code": "grammar_dead_end"}
        yield b"data: " + _encoder.encode({"error": err}) + b"\n\n"
    finally:
        await parts.aclose()
        close()
    yield b"data: [DONE]\n\n"


@post("/chat/completions", status_code=200, responses=ERRORS)
async def chat_completions(request: Request[Any, Any, Any], data: ChatCompletionBody) -> ChatCompletion:
    """A chat reply (`data:` chunks ending `data: [DONE]` when `stream` is true)."""
    started = time.perf_counter()
    svc = service(request)
    tenant = request_tenant(request)
    messages, ask, shape = ask_of(svc, data)
    gen = await svc.stateless(tenant, new_id("chatcmpl"), messages, ask)
    parts = run(svc, gen, shape, tenant, started)
    if shape.stream:
        close = closer(gen)

        async def after() -> None:  # also when the body never started (the client left at once)
            close()

        chunks = stream_chunks(svc, gen, shape, parts, close)
        stream = EventStream(chunks, media_type="text/event-stream", headers=HEADERS, background=BackgroundTask(after))
        return cast(ChatCompletion, stream)
    final: dict[str, Any] = {}
    async for part in parts:
        final = part
    choice = {
        "index": 0,
        "message": final["message"],
        "finish_reason": final["finish_reason"],
        "logprobs": {"content": final["logprobs"]} if shape.top_logprobs is not None else None,
    }
    body = {
        "id": gen.id,
        "created": int(time.time()),
        "model": svc.config.model,
        "choices": [choice],
        "usage": final["usage"],
    }
    return msgspec.convert(body, ChatCompletion)


def _model(request: Request[Any, Any, Any]) -> Model:
    svc = service(request)
    return Model(id=svc.config.model, created=0, owned_by="longctx", max_model_len=svc.engine.max_model_len)


@get("/models")
async def list_models(request: Request[Any, Any, Any]) -> ModelList:
    return ModelList(data=[_model(request)])


@get("/models/{model_id:path}", responses=ERRORS)
async def retrieve_model(request: Request[Any, Any, Any], model_id: str) -> Model:
    check_model(model_id.lstrip("/"), service(request).config.model)
    return _model(request)


router = Router(path="/v1", route_handlers=[chat_completions, list_models, retrieve_model], guards=[ready_guard])
