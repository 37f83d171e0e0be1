"""Conversations and responses: the objects of the OpenAI Conversations and Responses APIs as
msgspec Structs, which are also what the store writes to Redis (items: `sessions.items`).

- `Conversation` is the wire object (`conv_…`, `object: "conversation"`, created_at, metadata).
  Its tenant and version live only in Redis; the store returns them beside it, in
  `ConversationState`, so that a tenant can never leak into a response body.
- `Response` is the whole response object. Fields the Open Responses spec requires to be
  non-null (temperature, top_p, penalties, top_logprobs, service_tier, store, background,
  parallel_tool_calls, truncation, text.format, tool_choice, tools, metadata) have defaults and
  no `None`; nullable ones (completed_at, incomplete_details, error, usage, instructions,
  max_output_tokens, previous_response_id, conversation, reasoning, …) are always written,
  as null when unset. Echoed function tools always carry description, parameters and strict.
- `status` is one of completed, failed, in_progress, cancelled, queued, incomplete; a response
  in one of the TERMINAL states is final (the store never overwrites it).
"""

from __future__ import annotations

import time
from typing import Any, Literal, NamedTuple

import msgspec
from msgspec import UNSET, UnsetType

from sessions.ids import new_id
from sessions.items import Item

__all__ = [
    "TERMINAL",
    "Conversation",
    "ConversationRef",
    "ConversationState",
    "FunctionTool",
    "IncompleteDetails",
    "InputTokensDetails",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "OutputTokensDetails",
    "ReasoningConfig",
    "Response",
    "ResponseError",
    "ResponseStatus",
    "TextConfig",
    "TextFormat",
    "TextFormatText",
    "ToolChoice",
    "ToolChoiceFunction",
    "Usage",
    "decode_response",
    "encode",
    "new_id",
    "now",
]

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled", "incomplete"})


def now() -> int:
    """Unix time in seconds, as `created_at` and `completed_at` hold it."""
    return int(time.time())


# ---- conversations ----


class Conversation(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = {}


class ConversationState(NamedTuple):
    """A conversation with what only Redis holds: its tenant and its version (bumped by every
    change of its items; never goes back)."""

    conversation: Conversation
    tenant: str
    version: int


# ---- response parts ----


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str  # "max_output_tokens" or "content_filter"


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None  # none, minimal, low, medium, high, xhigh
    summary: str | None = None  # auto, concise, detailed


class FunctionTool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    name: str


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class TextFormatText(msgspec.Struct, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True):
    name: str
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | UnsetType = UNSET


TextFormat = TextFormatText | JsonObjectFormat | JsonSchemaFormat


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=TextFormatText)
    verbosity: Literal["low", "medium", "high"] | UnsetType = UNSET


class ConversationRef(msgspec.Struct):
    id: str


# ---- the response ----


class Response(msgspec.Struct, kw_only=True):
    id: str = msgspec.field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = msgspec.field(default_factory=now)
    completed_at: int | None = None
    status: ResponseStatus = "in_progress"
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    model: str
    output: list[Item] = []
    usage: Usage | None = None
    instructions: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    tools: list[dict[str, Any]] = []  # as `sessions.request_tools.parse_tools` echoes them
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    conversation: ConversationRef | None = None
    metadata: dict[str, str] = {}
    reasoning: ReasoningConfig | None = None
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @property
    def terminal(self) -> bool:
        """Whether this status is final (completed, failed, cancelled, incomplete)."""
        return self.status in TERMINAL


_encoder = msgspec.json.Encoder()
_response_decoder = msgspec.json.Decoder(Response)


def encode(obj: msgspec.Struct) -> bytes:
    """The wire JSON of any of these Structs (and of items)."""
    return _encoder.encode(obj)


def decode_response(raw: bytes) -> Response:
    """A response from its JSON (as stored, or as a client sent it back)."""
    return _response_decoder.decode(raw)
