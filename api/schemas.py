"""The msgspec types of the HTTP bodies that have no type in the session layer, so that the
OpenAPI schema Litestar serves (`/schema/openapi.json`) is concrete for every route.

Request bodies decode leniently: unknown fields are ignored (clients send new ones) and `null`
means "not given". The session layer's own types (`sessions.models.Response`,
`sessions.models.Conversation`, `sessions.items.Item`, `sessions.requests.CreateResponseBody`)
are used as they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from sessions.items import Item, ItemPage
from sessions.models import Usage

# ---- errors ----


class ErrorObject(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """OpenAI's error object, the body of every 4xx and 5xx."""

    error: ErrorObject


# ---- server ----


class ReadyBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`GET /ready`: 200 `status: ready` with the phases' seconds; 503 with the phase (and the error)."""

    phase: str
    status: str | None = None
    phase_seconds: dict[str, float] | None = None
    # The compiled step's buckets that passed their self-check, those running eager (why), and
    # those still compiling in the background (eager until checked).
    compiled_buckets: list[int] | None = None
    eager_buckets: dict[str, str] | None = None
    compiling_buckets: list[int] | None = None
    error: ErrorObject | None = None


# ---- lists and deletions ----


class ItemList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, page: ItemPage) -> ItemList:
        return cls(data=page.items, first_id=page.first_id, last_id=page.last_id, has_more=page.has_more)


class Deleted(msgspec.Struct, kw_only=True):
    id: str
    object: str  # "response.deleted", "conversation.deleted"
    deleted: bool


class Compacted(msgspec.Struct, kw_only=True):
    """`POST /v1/responses/compact`: a compaction item (always first) and the kept items."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    created_at: int
    output: list[Item]
    usage: Usage


# ---- conversations ----


class ConversationBody(msgspec.Struct, kw_only=True):
    """`POST /v1/conversations` and `POST /v1/conversations/{id}` (metadata only)."""

    items: list[Any] | None = None
    metadata: dict[str, Any] | None = None


class ItemsBody(msgspec.Struct, kw_only=True):
    """`POST /v1/conversations/{id}/items`."""

    items: list[Any] | None = None


# ---- chat completions and models ----


class ChatCompletionBody(msgspec.Struct, kw_only=True):
    """`POST /v1/chat/completions` as sent: decoding checks every field's type and range (a 400
    naming it); `api.chat.ask_of` checks what types cannot say."""

    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=4)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    n: int | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"]  # no default: omit_defaults would leave it out
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ChatUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    system_fingerprint: str | None = None


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Model]
