"""The body of `POST /v1/responses`: decoded as a msgspec Struct, then checked into a `ResponseRequest`.

`decode_request` accepts what clients send (unknown fields ignored, `null` as "not given") and
checks everything that can be checked without Redis or the engine, so that a bad request fails
before any write or engine call. Every failure is an `InvalidParam` whose `param` is the
offending field's path (`tools[1].type`, `text.format.schema`, `input[2].call_id`), mapped to
one 400 by the HTTP layer.

Tools, `tool_choice` and `text.format` arrive in the Responses API's flat shapes; they are
checked here for what a response echoes (`sessions.request_tools`), and by `tools/` for their
schemas and grammar (`tools.schema.parse_tools`, `GrammarCompiler.for_request`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from engine.sampling_params import SamplingParams
from sessions.errors import InvalidParam
from sessions.items import InvalidItem, Item, parse_input
from sessions.models import (
    ConversationRef,
    JsonObjectFormat,
    JsonSchemaFormat,
    ReasoningConfig,
    Response,
    TextConfig,
)
from sessions.request_tools import parse_text, parse_tool_choice, parse_tools

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_METADATA = 16


class CreateResponseBody(msgspec.Struct, kw_only=True):
    """`POST /v1/responses` as sent; unknown fields are ignored (msgspec's default)."""

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    context_management: list[dict[str, Any]] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    seed: int | None = None


@dataclass(frozen=True)
class ResponseRequest:
    """A checked request. `input_items` have ids; `tools` are the echoed function tools."""

    body: CreateResponseBody
    input_items: list[Item]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    text: TextConfig = field(default_factory=TextConfig)
    conversation_id: str | None = None

    @property
    def store(self) -> bool:
        return self.body.store is not False

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def background(self) -> bool:
        return bool(self.body.background)

    @property
    def thinking(self) -> bool:
        """False when `reasoning.effort` is `none`: the template's thinking switch goes off."""
        return not (self.body.reasoning is not None and self.body.reasoning.effort == "none")

    @property
    def slot_of(self) -> str | None:
        """The id whose slot tag a new response shares (`sessions.ids`): its conversation's, or its
        previous response's (so a whole chain lies in one Redis Cluster slot)."""
        return self.conversation_id or self.body.previous_response_id

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` in Chat's `response_format` shape; None for free text."""
        f = self.text.format
        if isinstance(f, JsonSchemaFormat):
            return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema, "strict": f.strict}}
        if isinstance(f, JsonObjectFormat):
            return {"type": "json_object"}
        return None

    def response(self, model: str, max_output_tokens: int | None) -> Response:
        """The response object this request starts (`in_progress`, or `queued` in the background)."""
        b = self.body
        return Response(
            model=model,
            status="queued" if self.background else "in_progress",
            instructions=b.instructions,
            temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p,
            presence_penalty=b.presence_penalty or 0.0,
            frequency_penalty=b.frequency_penalty or 0.0,
            top_logprobs=b.top_logprobs or 0,
            max_output_tokens=max_output_tokens,
            max_tool_calls=b.max_tool_calls,
            tools=list(self.tools),
            tool_choice=self.tool_choice,
            parallel_tool_calls=b.parallel_tool_calls is not False,
            text=self.text,
            truncation=b.truncation or "disabled",
            store=self.store,
            background=self.background,
            previous_response_id=b.previous_response_id,
            conversation=ConversationRef(self.conversation_id) if self.conversation_id else None,
            metadata=dict(b.metadata or {}),
            reasoning=_reasoning(b.reasoning),
            service_tier=b.service_tier or "default",
            safety_identifier=b.safety_identifier,
            prompt_cache_key=b.prompt_cache_key,
            prompt_cache_retention=b.prompt_cache_retention,
        )


_decoder = msgspec.json.Decoder(CreateResponseBody)


def decode_request(raw: bytes | dict[str, Any] | CreateResponseBody) -> ResponseRequest:
    """A checked request from the JSON body (bytes), decoded JSON, or a decoded Struct.

    Raises:
        InvalidParam: naming the first bad field.
    """
    try:
        if isinstance(raw, CreateResponseBody):
            body = raw
        elif isinstance(raw, dict):
            body = msgspec.convert({k: v for k, v in raw.items() if v is not None}, CreateResponseBody)
        else:
            body = _decoder.decode(raw)
    except msgspec.ValidationError as e:
        message, _, path = str(e).partition(" - at `$")
        raise InvalidParam(path.rstrip("`").lstrip(".") or "body", message) from None
    except msgspec.DecodeError as e:
        raise InvalidParam("body", f"malformed JSON: {e}") from None
    return check(body)


def check(body: CreateResponseBody) -> ResponseRequest:
    """Every check of the body that needs neither Redis nor the engine (see the module docstring)."""
    if body.conversation is not None and body.previous_response_id is not None:
        raise InvalidParam("conversation", "cannot be used together with previous_response_id")
    if body.background and body.store is False:
        raise InvalidParam("background", "a background response must be stored (store: true)")
    _check_sampling(body)
    try:
        items = parse_input(body.input if body.input is not None else [])
    except InvalidItem as e:
        raise InvalidParam(e.param, e.message) from None
    if not items and body.previous_response_id is None and body.conversation is None:
        raise InvalidParam("input", "input is required (a string or a list of items)")
    tools, specs = parse_tools(body.tools or [])
    choice = parse_tool_choice(body.tool_choice, specs)
    text = parse_text(body.text)
    conv = body.conversation
    conv_id = conv if isinstance(conv, str) else conv.id if conv is not None else None
    _check_context_management(body.context_management)
    if body.reasoning is not None and body.reasoning.effort not in (None, *EFFORTS):
        raise InvalidParam("reasoning.effort", f"expected one of {', '.join(EFFORTS)}, got {body.reasoning.effort!r}")
    return ResponseRequest(body, items, tools=tools, tool_choice=choice, text=text, conversation_id=conv_id)


def _check_sampling(b: CreateResponseBody) -> None:
    if b.temperature is not None and not 0 <= b.temperature <= 2:
        raise InvalidParam("temperature", f"must be in [0, 2], got {b.temperature}")
    if b.top_p is not None and not 0 < b.top_p <= 1:
        raise InvalidParam("top_p", f"must be in (0, 1], got {b.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(b, name)
        if v is not None and not -2 <= v <= 2:
            raise InvalidParam(name, f"must be in [-2, 2], got {v}")
    if b.max_output_tokens is not None and b.max_output_tokens < 1:
        raise InvalidParam("max_output_tokens", f"must be >= 1, got {b.max_output_tokens}")
    if b.top_logprobs is not None and not 0 <= b.top_logprobs <= 20:
        raise InvalidParam("top_logprobs", f"must be in [0, 20], got {b.top_logprobs}")
    check_metadata(b.metadata)
    if b.max_tool_calls is not None and b.max_tool_calls < 1:
        raise InvalidParam("max_tool_calls", f"must be >= 1, got {b.max_tool_calls}")
    if b.prompt_cache_retention not in (None, "in_memory", "in-memory", "24h"):
        raise InvalidParam("prompt_cache_retention", f"expected in_memory or 24h, got {b.prompt_cache_retention!r}")
    if b.client_metadata is not None and not all(isinstance(v, str) for v in b.client_metadata.values()):
        raise InvalidParam("client_metadata", "expected an object of string values")


def check_metadata(metadata: Any) -> dict[str, str]:
    """Metadata as the API allows it: at most 16 string pairs, keys <= 64 and values <= 512 chars."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidParam("metadata", "expected an object of string values")
    if len(metadata) > MAX_METADATA:
        raise InvalidParam("metadata", f"at most {MAX_METADATA} keys, got {len(metadata)}")
    for k, v in metadata.items():
        if len(k) > 64 or len(v) > 512:
            raise InvalidParam(f"metadata.{k}", "keys are at most 64 characters and values at most 512")
    return dict(metadata)


def _check_context_management(raw: list[dict[str, Any]] | None) -> None:
    for i, entry in enumerate(raw or []):
        if entry.get("type") != "compaction":
            raise InvalidParam(f"context_management[{i}].type", f"expected 'compaction', got {entry.get('type')!r}")
        threshold = entry.get("compact_threshold")
        if threshold is not None and (not isinstance(threshold, int) or threshold < 1):
            raise InvalidParam(f"context_management[{i}].compact_threshold", "expected a positive number of tokens")


def _reasoning(r: ReasoningConfig | None) -> ReasoningConfig | None:
    # Open Responses: reasoning is null or carries both effort and summary.
    return None if r is None else ReasoningConfig(effort=r.effort, summary=r.summary)


def sampling_params(renames: dict[str, str] | None = None, **kwargs: Any) -> SamplingParams:
    """`SamplingParams(**kwargs)`, its checks' errors as InvalidParam naming the request field
    (`SamplingParams` names its own, e.g. `stop`; `renames` maps those to the request's names)."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        field, sep, why = str(e).partition(": ")
        if not sep:
            raise InvalidParam("body", str(e)) from None
        raise InvalidParam((renames or {}).get(field, field), why) from None
