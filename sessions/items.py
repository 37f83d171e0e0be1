"""Conversation items: the wire shapes of the Responses and Conversations APIs, which are also
what Redis holds (an item's Redis value is exactly its wire JSON, so what a client reads back is
what was written).

An item is one of seven msgspec Structs, tagged by `type`:

    message               id, role (system|developer|user|assistant), content, status, phase?
    function_call         id (fc_…), call_id, name, arguments (a JSON string), status, namespace?
    function_call_output  id, call_id, output (a string), status
    custom_tool_call      id (ctc_…), call_id, name, input (free text), status, namespace?
    custom_tool_call_output  id, call_id, output (a string), status
    reasoning             id, summary (summary_text parts), content (reasoning_text parts)
    compaction            id, encrypted_content (our signed summary)

Message content is a list of parts: `input_text`, `input_image` (`image_url`, `file_id` and
`detail` as sent; `sessions.image_parts` reads them), `output_text` (always with `annotations`,
`logprobs` only when given) or `refusal`. `phase` (commentary|final_answer) is omitted when
unset, never null. Every stored item has an id and a status.

`parse_input` accepts what clients really send (the OpenAI Agents SDK among them): a plain
string; messages without `type`; string content; items without `id` or `status` (they get new
ones); `null` for any optional field; the server's own output items sent back whole; unknown
fields (ignored). Anything else is an `InvalidItem` naming the JSON path.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgspec
from msgspec import UNSET, UnsetType

from sessions.ids import new_id

Role = Literal["system", "developer", "user", "assistant"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
Phase = Literal["commentary", "final_answer"]


class InvalidItem(ValueError):
    """An input item that cannot be read; `param` is its JSON path, e.g. `input[2].content[0].text`."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.message = message
        self.param = param


# ---- content parts ----


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", kw_only=True, omit_defaults=True, dict=True):
    """An image: a data URL or an http(s) URL in `image_url` (a `file_id` is refused when read).

    A part with an http(s) URL carries, once read, the bytes fetched for it (`fetched`), so the
    turn that sent it and every later rendering use those bytes and never fetch the URL again.
    They live in the instance's `__dict__`, which msgspec never encodes or decodes: they cannot
    leak into the API's JSON, nor be sent by a client."""

    image_url: str | UnsetType = UNSET
    file_id: str | UnsetType = UNSET
    detail: Literal["auto", "low", "high", "original"] | UnsetType = UNSET

    @property
    def fetched(self) -> bytes | None:
        """The bytes read for an http(s) `image_url` (by the request's checks, or from the store)."""
        return self.__dict__.get("fetched")

    def keep_fetched(self, data: bytes) -> None:
        self.__dict__["fetched"] = data


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | UnsetType = UNSET


class Refusal(msgspec.Struct, tag="refusal", tag_field="type"):
    refusal: str


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type"):
    text: str


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


Part = InputText | InputImage | OutputText | Refusal


# ---- items ----


class Message(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    role: Role
    content: list[Part]
    status: ItemStatus = "completed"
    phase: Phase | UnsetType = UNSET


class FunctionCall(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str  # within its namespace, when it has one
    arguments: str  # JSON text, as the model wrote it
    status: ItemStatus = "completed"
    namespace: str | UnsetType = UNSET  # the namespace tool it belongs to (omitted when none)

    @property
    def qualified_name(self) -> str:
        """The name the model called it by: `namespace.name` inside a namespace."""
        return f"{self.namespace}.{self.name}" if isinstance(self.namespace, str) else self.name


class CustomToolCall(msgspec.Struct, tag="custom_tool_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    input: str  # free text, as the model wrote it
    status: ItemStatus = "completed"
    namespace: str | UnsetType = UNSET

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}" if isinstance(self.namespace, str) else self.name


class CustomToolCallOutput(msgspec.Struct, tag="custom_tool_call_output", tag_field="type", kw_only=True):
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


class FunctionCallOutput(msgspec.Struct, tag="function_call_output", tag_field="type", kw_only=True):
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


class Reasoning(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    id: str
    summary: list[SummaryText] = []
    content: list[ReasoningText] = []
    encrypted_content: str | UnsetType = UNSET


class Compaction(msgspec.Struct, tag="compaction", tag_field="type", kw_only=True):
    id: str
    encrypted_content: str


Item = Message | FunctionCall | FunctionCallOutput | CustomToolCall | CustomToolCallOutput | Reasoning | Compaction
Call = FunctionCall | CustomToolCall
CallOutput = FunctionCallOutput | CustomToolCallOutput

ID_KINDS: dict[str, str] = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
    "compaction": "cmp",
}

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Item)


class ItemPage(NamedTuple):
    """One page of a list endpoint (`{"object": "list", "data", "first_id", "last_id", "has_more"}`);
    a client pages on with `after=last_id` while `has_more`."""

    items: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, items: list[Item], has_more: bool) -> ItemPage:
        return cls(items, items[0].id if items else None, items[-1].id if items else None, has_more)


def check_page(limit: int, order: str) -> None:
    """Raise ValueError unless 1 <= limit <= 100 and order is asc or desc."""
    if not 1 <= limit <= 100:
        raise ValueError(f"limit must be 1..100, got {limit}")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")


def encode_item(item: Item) -> bytes:
    """The wire JSON of an item, also its Redis value."""
    return _encoder.encode(item)


def decode_item(raw: bytes) -> Item:
    """An item as stored by `encode_item` (strict: stored items are always complete)."""
    return _decoder.decode(raw)


def text_of(item: Item) -> str:
    """The text of a message's parts (refusals included, images left out), joined; '' for other items."""
    if not isinstance(item, Message):
        return ""
    parts = [p for p in item.content if not isinstance(p, InputImage)]
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in parts)


def images_of(items: list[Item]) -> list[tuple[int, int, InputImage]]:
    """The image parts of `items`, in order: (item index, part index, part)."""
    return [
        (i, j, p)
        for i, item in enumerate(items)
        if isinstance(item, Message)
        for j, p in enumerate(item.content)
        if isinstance(p, InputImage)
    ]


# ---- lenient input ----


TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"})
PARTS = TEXT_PARTS | {"input_image"}


def parse_input(value: Any) -> list[Item]:
    """Items from a request's `input` (or a `POST …/items` body's `items`).

    Args:
        value: a string (one user message), a list of item objects as decoded JSON, or the
            raw JSON bytes of either.
    Returns:
        Complete items, with new ids where none were given.
    Raises:
        InvalidItem: naming the first bad item and field.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as e:
            raise InvalidItem(str(e), "input") from None
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidItem("expected a string or a list of items", "input")
    return [parse_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def parse_item(raw: Any, param: str = "item") -> Item:
    """One item in any accepted input form (see the module docstring); raises InvalidItem."""
    if not isinstance(raw, dict):
        raise InvalidItem("expected an object", param)
    d = _without_nulls(raw)
    if "type" not in d and "role" in d:
        d["type"] = "message"
    kind = d.get("type")
    if kind == "message" and isinstance(d.get("content"), str):
        part = "output_text" if d.get("role") == "assistant" else "input_text"
        d["content"] = [{"type": part, "text": d["content"]}]
    for key in ("content", "summary"):
        if isinstance(d.get(key), list):
            d[key] = [_without_nulls(p) if isinstance(p, dict) else p for p in d[key]]
    if kind == "message" and isinstance(d.get("content"), list):
        for j, p in enumerate(d["content"]):
            t = p.get("type") if isinstance(p, dict) else None
            if isinstance(t, str) and t not in PARTS:
                raise InvalidItem(
                    f"content part type {t!r} is not supported; only text and input_image are",
                    f"{param}.content[{j}].type",
                )
    if isinstance(kind, str) and kind not in ID_KINDS:
        raise InvalidItem(f"unknown item type {kind!r}; supported: {', '.join(ID_KINDS)}", f"{param}.type")
    if kind in ("function_call_output", "custom_tool_call_output") and isinstance(d.get("output"), list):
        d["output"] = "".join(p.get("text", "") for p in d["output"] if isinstance(p, dict))
    if isinstance(kind, str) and kind in ID_KINDS and "id" not in d:
        d["id"] = new_id(ID_KINDS[kind])
    try:
        return msgspec.convert(d, Item)
    except msgspec.ValidationError as e:
        message, _, path = str(e).partition(" - at `$")
        raise InvalidItem(message, param + path.rstrip("`")) from None


def _without_nulls(d: dict[str, Any]) -> dict[str, Any]:
    # Every optional field here is non-nullable on the wire: null means "not given".
    return {k: v for k, v in d.items() if v is not None}
