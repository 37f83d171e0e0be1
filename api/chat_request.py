"""A Chat Completions request's checks and what it asks of its reply.

`ChatCompletionBody` (`api.schemas`) types and bounds every field as it is decoded (a 400 naming
the field); `ask_of` checks what types cannot say (the served model, each message's role and
parts, `n`, `logit_bias`, the tools and `tool_choice`, `top_logprobs` without `logprobs`) and
returns the session layer's `ReplyAsk` in Chat's field names, and the reply's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.schemas import ChatCompletionBody
from sessions.errors import InvalidParam, check_model
from sessions.generation import ReplyAsk
from sessions.service import SessionService
from tools.constraints import parse_output_format
from tools.schema import parse_tools

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


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
