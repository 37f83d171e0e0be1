"""Chat Completions and Models, stateless over the same renderer, grammar compiler and prefix cache
as the Responses API (the session layer's service holds them).

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

import asyncio
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
from api.limits import tenant_queue
from api.metrics import METRICS
from api.responses import ERRORS, service
from api.schemas import ChatCompletion, ChatCompletionBody, Model, ModelList
from api.sse import HEADERS, EventStream
from engine.request import FinishReason, RequestHandle
from engine.sampling_params import SamplingParams
from sessions import errors
from sessions.errors import ContextLengthExceeded, InvalidParam
from sessions.ids import new_id
from sessions.reasoning import ReasoningSplitter, opens_in_reasoning
from sessions.render import encode, render_text
from sessions.requests import sampling_params
from sessions.service import SessionService
from sessions.waiting import WaitingPlace
from tools.calls import ToolCallParser
from tools.schema import parse_tools

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_encoder = msgspec.json.Encoder()


class GrammarDeadEnd(RuntimeError):
    pass


register("GrammarDeadEnd", ErrorSpec(500, "server_error", "grammar_dead_end", param=lambda e: None))


def check_model(svc: SessionService, model: Any) -> None:
    errors.check_model(model, svc.config.model)


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise InvalidParam(name, f"expected a number from {lo} to {hi}, got {v!r}")
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise InvalidParam(name, f"expected an integer from {lo}{f' to {hi}' if hi is not None else ''}, got {v!r}")
    return v


def check_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise InvalidParam("messages", "expected a non-empty list of messages")
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidParam(f"messages[{i}]", "a message must be an object")
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
    return raw


@dataclass
class ChatPlan:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    grammar: Any
    reply: ChatReply
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    started: float = 0.0  # perf_counter at the HTTP request's start (time to first token)


async def plan(svc: SessionService, body: dict[str, Any]) -> ChatPlan:
    """Every check, the prompt and the sampling settings; raises 4xx errors before any engine call."""
    check_model(svc, body.get("model"))
    messages = check_messages(body.get("messages"))
    n = body.get("n")
    if n is not None and n != 1:
        raise InvalidParam("n", f"n={n!r} is not supported: only one choice (n=1)")
    if body.get("logit_bias"):
        raise InvalidParam("logit_bias", "logit_bias is not supported")
    try:
        specs = parse_tools(body.get("tools"))
    except ValueError as e:
        param = getattr(e, "param", None) or "tools"
        raise InvalidParam(param, str(e).removeprefix(f"{param}: ")) from None
    tool_choice = body.get("tool_choice")
    tools = specs if tool_choice != "none" else []
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParam("parallel_tool_calls", f"expected true or false, got {parallel!r}")
    if tool_choice is not None and not specs and tool_choice not in ("none", "auto"):
        raise InvalidParam("tool_choice", "tool_choice needs tools, but the request declares none")
    fmt = body.get("response_format")

    def compile_grammar() -> Any:
        if not tools and (fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")):
            return None
        return svc.compiler.for_request(fmt, tools, tool_choice, parallel is not False, svc.tool_format)

    grammar = await asyncio.to_thread(compile_grammar)  # raises InvalidRequest naming the field
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (
        not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(x, str) for x in stops)
    ):
        raise InvalidParam("stop", "expected a string or a list of at most 4 strings")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidParam("logprobs", f"expected true or false, got {logprobs!r}")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not logprobs:
        raise InvalidParam("top_logprobs", "top_logprobs needs logprobs: true")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise InvalidParam("stream_options", "expected an object")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidParam("stream", f"expected true or false, got {stream!r}")
    seed = _int(body, "seed", -(2**63))
    asked_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = _int(body, asked_name, 1)
    temperature = _number(body, "temperature", 0, 2, svc.config.temperature)
    top_p = _number(body, "top_p", 0, 1, 1.0)
    presence = _number(body, "presence_penalty", -2, 2, 0.0)
    frequency = _number(body, "frequency_penalty", -2, 2, 0.0)

    def render() -> tuple[list[int], str]:
        text = render_text(svc.tokenizer, messages, specs if tool_choice != "none" else [])
        return encode(svc.tokenizer, text), text

    ids, text = await svc.fitter.tokenizing.run(render)  # the service's one tokenizer thread
    limit = min(svc.engine.max_model_len, svc.engine.capacity_tokens)
    cap = svc.config.max_output_tokens
    if asked is not None and asked > cap:
        raise InvalidParam(asked_name, f"at most {cap} on this server, got {asked}")
    if len(ids) + (asked or 1) > limit:
        raise ContextLengthExceeded(
            "messages", f"the prompt is {len(ids)} tokens and asks for {asked or 1} more; the limit is {limit} tokens"
        )
    max_tokens = asked if asked is not None else min(limit - len(ids), cap)
    params = sampling_params(
        {"max_tokens": asked_name, "logprobs": "top_logprobs"},
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, presence_penalty=presence,
        frequency_penalty=frequency, seed=seed, stop=tuple(stops or ()),
        logprobs=(top or 0) if logprobs else None, skip_special_tokens=not (svc.keep_special and bool(tools)),
    )  # fmt: skip
    parser = ToolCallParser(svc.tool_format, specs) if tools else None
    splitter = ReasoningSplitter(svc.reasoning, svc.reasoning and opens_in_reasoning(text))
    return ChatPlan(
        new_id("chatcmpl"), ids, params, grammar, ChatReply(parser, splitter), bool(stream),
        bool((opts or {}).get("include_usage")), top if logprobs else None,
    )  # fmt: skip


def _finish(reason: FinishReason | None, reply: ChatReply) -> str:
    if reason == FinishReason.LENGTH:
        return "length"
    return "tool_calls" if reply.calls else "stop"


def _usage(prompt: int, cached: int, output: int, reasoning: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }  # fmt: skip


def submit(svc: SessionService, p: ChatPlan, slot: WaitingPlace) -> RequestHandle:
    """Add the engine request before any byte is sent, so that refusals (429, 400) are plain errors.
    It holds the tenant's waiting `slot` until `run` sees its first output (released on failure)."""
    matcher = svc.compiler.matcher(p.grammar) if p.grammar is not None else None
    try:
        return svc.engine.add_request(p.prompt_ids, p.params, request_id=p.id, cache_salt=slot.tenant, matcher=matcher)
    except BaseException:
        slot.release()
        raise


def closer(handle: RequestHandle, slot: WaitingPlace) -> Callable[[], None]:
    """What ends a request whose reader is gone, whether or not `run` ever started: the slot is
    released and an unfinished engine request aborted."""

    def close() -> None:
        slot.release()
        if not handle.done:
            handle.abort()

    return close


async def run(
    svc: SessionService, p: ChatPlan, tenant: str, handle: RequestHandle, slot: WaitingPlace
) -> AsyncGenerator[dict[str, Any], None]:
    """The reply as chunk bodies; the last one has `finish_reason` (and `usage`, `message`, logprobs)."""
    output = cached = reasoning = 0
    last: float | None = None
    reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[dict[str, Any]] = []
    try:
        async for out in handle:
            slot.release()
            if out.token_ids:
                now = time.perf_counter()
                if last is None:
                    METRICS.ttft.observe(now - p.started)
                else:
                    METRICS.itl.observe(now - last)
                last = now
            if p.reply.in_reasoning:
                reasoning += len(out.token_ids)
            output += len(out.token_ids)
            cached = out.cached_tokens
            lps = token_logprobs(svc.tokenizer, out.logprobs, p.top_logprobs or 0) if out.logprobs else []
            logprobs += lps
            deltas = p.reply.feed(out.text_delta) if out.text_delta else []
            if out.finish_reason is not None:
                reason, error = out.finish_reason, out.error
                deltas += p.reply.finish()
            for i, d in enumerate(deltas):
                yield {"delta": d, "logprobs": lps if i == 0 and lps else None}
            if lps and not deltas:
                yield {"delta": {}, "logprobs": lps}
    finally:
        slot.release()
        if reason is None:  # the client left, or the task was cancelled: stop the engine too
            handle.abort()
    METRICS.count_tokens(tenant, len(p.prompt_ids), cached, output)
    if reason == FinishReason.ERROR:
        raise GrammarDeadEnd(error or "the grammar admits no further token")
    yield {
        "finish_reason": _finish(reason, p.reply), "message": p.reply.message(), "logprobs": logprobs,
        "usage": _usage(len(p.prompt_ids), cached, output, reasoning),
    }  # fmt: skip


def _chunk(p: ChatPlan, model: str, created: int, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    body = {"id": p.id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    return b"data: " + _encoder.encode(body | extra) + b"\n\n"


async def stream_chunks(
    svc: SessionService, p: ChatPlan, gen: AsyncGenerator[dict[str, Any], None], close: Callable[[], None]
) -> AsyncIterator[bytes]:
    """The SSE body; `close` runs however it ends (a client gone before `gen` started included)."""
    model, created = svc.config.model, int(time.time())
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    try:
        yield _chunk(p, model, created, [first])
        async for part in gen:
            if "finish_reason" in part:
                last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": part["finish_reason"]}
                yield _chunk(p, model, created, [last])
                if p.include_usage:
                    yield _chunk(p, model, created, [], usage=part["usage"])
                break
            lp = {"content": part["logprobs"]} if part["logprobs"] else None
            choice = {"index": 0, "delta": part["delta"], "logprobs": lp, "finish_reason": None}
            yield _chunk(p, model, created, [choice])
    except GrammarDeadEnd as e:
        err = {"message": str(e), "type": "server_error", "param": None, "code": "grammar_dead_end"}
        yield b"data: " + _encoder.encode({"error": err}) + b"\n\n"
    finally:
        await gen.aclose()
        close()
    yield b"data: [DONE]\n\n"


@post("/chat/completions", status_code=200, responses=ERRORS)
async def chat_completions(request: Request[Any, Any, Any], data: ChatCompletionBody) -> ChatCompletion:
    """A chat reply (`data:` chunks ending `data: [DONE]` when `stream` is true)."""
    started = time.perf_counter()
    svc = service(request)
    tenant = request_tenant(request)
    p = await plan(svc, data.given())
    p.started = started
    slot = WaitingPlace(tenant_queue(request.app.state.server), tenant)
    handle = submit(svc, p, slot)
    gen = run(svc, p, tenant, handle, slot)
    if p.stream:
        close = closer(handle, slot)

        async def after() -> None:  # also when the body never started (the client left at once)
            close()

        chunks = stream_chunks(svc, p, gen, close)
        stream = EventStream(chunks, media_type="text/event-stream", headers=HEADERS, background=BackgroundTask(after))
        return cast(ChatCompletion, stream)
    final: dict[str, Any] = {}
    async for part in gen:
        final = part
    choice = {
        "index": 0, "message": final["message"], "finish_reason": final["finish_reason"],
        "logprobs": {"content": final["logprobs"]} if p.top_logprobs is not None else None,
    }  # fmt: skip
    body = {
        "id": p.id, "object": "chat.completion", "created": int(time.time()), "model": svc.config.model,
        "choices": [choice], "usage": final["usage"], "system_fingerprint": None,
    }  # fmt: skip
    return cast(ChatCompletion, body)


def _model(request: Request[Any, Any, Any]) -> Model:
    svc = service(request)
    return Model(id=svc.config.model, created=0, owned_by="longctx", max_model_len=svc.engine.max_model_len)


@get("/models")
async def list_models(request: Request[Any, Any, Any]) -> ModelList:
    return ModelList(data=[_model(request)])


@get("/models/{model_id:path}", responses=ERRORS)
async def retrieve_model(request: Request[Any, Any, Any], model_id: str) -> Model:
    check_model(service(request), model_id.lstrip("/"))
    return _model(request)


router = Router(path="/v1", route_handlers=[chat_completions, list_models, retrieve_model], guards=[ready_guard])
