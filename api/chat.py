"""Chat Completions and Models: a Chat request is a stateless turn of the session service
(`SessionService.stateless`: no conversation, no stored items), planned, submitted and read by
the same code as a Responses turn (`sessions.generation`: output limits, grammar, tool-call
parsing, cancellation, usage). This module holds only Chat's shapes: `messages` and the request's
fields in, `chat.completion` or its chunks out.

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
from dataclasses import dataclass
from typing import Any, cast

import msgspec
from litestar import Request, Router, get, post
from litestar.background_tasks import BackgroundTask

from api.app import ready_guard
from api.auth import tenant as request_tenant
from api.chat_reply import ChatReply, token_logprobs
from api.errors import ErrorSpec, register
from api.metrics import METRICS
from api.responses import ERRORS, service
from api.schemas import ChatCompletion, ChatCompletionBody, Model, ModelList
from api.sse import HEADERS, EventStream
from engine.request import FinishReason
from sessions.errors import InvalidParam, check_model
from sessions.generation import Generation, ReplyAsk
from sessions.ids import new_id
from sessions.models import Usage
from sessions.service import SessionService
from tools.constraints import parse_output_format
from tools.schema import parse_tools

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_encoder = msgspec.json.Encoder()


class GrammarDeadEnd(RuntimeError):
    pass


register("GrammarDeadEnd", ErrorSpec(500, "server_error", "grammar_dead_end", param=lambda e: None))


def check_messages(messages: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """What the body's types leave to check of `messages` (each is an object already)."""
    if not messages:
        raise InvalidParam("messages", "expected a non-empty list of messages")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise InvalidParam(f"messages[{i}].role", f"expected one of {sorted(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidParam(f"messages[{i}].content", "expected a string or a list of text parts")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise InvalidParam(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise InvalidParam(f"messages[{i}].tool_calls", "only an assistant message has a list of tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidParam(f"messages[{i}].tool_calls[{j}].function", "expected {name, arguments}")
    return messages


@dataclass(frozen=True)
class ChatShape:
    """What only the chat reply's shape needs: streamed or not, usage chunk, logprobs."""

    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs


def ask_of(svc: SessionService, body: ChatCompletionBody) -> tuple[list[dict[str, Any]], ReplyAsk, ChatShape]:
    """The checks the body's types leave (raising 4xx errors before any engine call): the
    messages, what the request asks of its reply in Chat's field names, and the reply's shape."""
    check_model(body.model, svc.config.model)
    messages = check_messages(body.messages)
    if body.n is not None and body.n != 1:
        raise InvalidParam("n", f"n={body.n!r} is not supported: only one choice (n=1)")
    if body.logit_bias:
        raise InvalidParam("logit_bias", "logit_bias is not supported")
    try:
        tools = parse_tools(body.tools)
    except ValueError as e:
        param = getattr(e, "param", None) or "tools"
        raise InvalidParam(param, str(e).removeprefix(f"{param}: ")) from None
    if body.tool_choice is not None and not tools and body.tool_choice not in ("none", "auto"):
        raise InvalidParam("tool_choice", "tool_choice needs tools, but the request declares none")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidParam("top_logprobs", "top_logprobs needs logprobs: true")
    asked_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    top = (body.top_logprobs or 0) if body.logprobs else None
    ask = ReplyAsk(
        tools=tools,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output_format=parse_output_format(body.response_format),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        max_tokens_param=asked_name,
        prompt_param="messages",
        temperature=svc.config.temperature if body.temperature is None else body.temperature,
        top_p=svc.config.top_p if body.top_p is None else body.top_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        logprobs=top,
    )
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return messages, ask, ChatShape(bool(body.stream), include_usage, top)


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
