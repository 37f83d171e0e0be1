"""Items and responses as msgspec Structs: the lenient input forms clients send (the OpenAI Agents
SDK's among them) become complete items, bad input names its JSON path, and a response object
carries every field Open Responses requires, non-null where it must be."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from sessions.items import (
    Compaction,
    FunctionCall,
    FunctionCallOutput,
    InputText,
    InvalidItem,
    Message,
    OutputText,
    Reasoning,
    decode_item,
    encode_item,
    parse_input,
    text_of,
)
from sessions.models import Conversation, JsonSchemaFormat, Response, TextConfig, Usage, decode_response, encode, new_id

# What the OpenAI Agents SDK re-sends as input (NOTES.md): messages without `type`, string
# content, our own output items with ids, statuses, extra fields, annotations and logprobs.
SDK_INPUT: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "developer", "content": "Answer briefly."},
    {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be terse."}]},
    {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "phase": "commentary",
        "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
    },
    {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
        "created_at": 1700000000,
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "status": None},
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "weather"}],
        "content": [{"type": "reasoning_text", "text": "look it up"}],
        "encrypted_content": None,
    },
    {"type": "compaction", "id": "cmp_1", "encrypted_content": "signed-summary"},
    {"role": "assistant", "content": "Sunny.", "phase": None, "id": None, "status": None},
]

# Fields Open Responses requires on every response object; those in NON_NULL never null.
REQUIRED = (  # noqa: SIM905
    "id object created_at completed_at status incomplete_details model previous_response_id instructions "
    "output error tools tool_choice truncation parallel_tool_calls text top_p presence_penalty "
    "frequency_penalty top_logprobs temperature reasoning usage max_output_tokens max_tool_calls store "
    "background service_tier metadata safety_identifier prompt_cache_key"
).split()
NON_NULL = (  # noqa: SIM905
    "temperature top_p presence_penalty frequency_penalty top_logprobs service_tier store background "
    "parallel_tool_calls truncation text tool_choice tools metadata output status model"
).split()


def test_sdk_input_forms_become_complete_items() -> None:
    items = parse_input(SDK_INPUT)
    kinds = [Message] * 4 + [FunctionCall, FunctionCallOutput, Reasoning, Compaction, Message]
    assert [type(i) for i in items] == kinds
    user, developer, system, said, call, output, reasoning, _, answer = items
    assert isinstance(user, Message) and user.content == [InputText("What is the weather in Paris?")]
    assert isinstance(developer, Message) and developer.role == "developer" and user.status == "completed"
    assert (
        isinstance(said, Message)
        and said.phase == "commentary"
        and said.content[0] == OutputText(text="Checking.", annotations=[], logprobs=[])
    )
    assert isinstance(call, FunctionCall) and (call.id, call.arguments) == ("fc_1", '{"city": "Paris"}')
    assert isinstance(output, FunctionCallOutput) and output.status == "completed"
    assert isinstance(answer, Message) and answer.content == [OutputText(text="Sunny.")]
    assert all(re.fullmatch(r"(msg|fco)_[0-9a-f]{48}", i.id) for i in (user, developer, system, output, answer))
    assert text_of(answer) == "Sunny." and text_of(call) == ""
    for item in items:
        assert decode_item(encode_item(item)) == item
    wire = msgspec.json.decode(encode_item(answer))
    assert wire == {
        "type": "message",
        "id": answer.id,
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
        "status": "completed",
    }  # phase and logprobs omitted when unset, never null
    assert "encrypted_content" not in msgspec.json.decode(encode_item(reasoning))
    assert parse_input("hi")[0].content == [InputText("hi")]  # type: ignore[union-attr]
    assert parse_input(b'[{"role": "user", "content": "hi"}]')[0].content == [InputText("hi")]  # type: ignore[union-attr]
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    out = parse_input([{"type": "function_call_output", "call_id": "c", "output": parts}])[0]
    assert isinstance(out, FunctionCallOutput) and out.output == "ab"


@pytest.mark.parametrize(
    ("value", "param", "message"),
    [
        (5, "input", "expected a string or a list"),
        (["hi"], "input[0]", "expected an object"),
        ([{"role": "user", "content": [{"type": "input_text", "text": 5}]}], "input[0].content[0].text", "Expected"),
        ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type", "unknown item type"),
        ([{"role": "tool", "content": "x"}], "input[0].role", "Invalid enum value"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0]", "call_id"),
        (b"[{", "input", "truncated"),
    ],
)
def test_bad_input_names_its_path(value: Any, param: str, message: str) -> None:
    with pytest.raises(InvalidItem) as e:
        parse_input(value)
    assert e.value.param == param and message in e.value.message


def test_response_carries_every_required_field() -> None:
    r = Response(model="m", output=parse_input("hi"), usage=Usage(input_tokens=3, output_tokens=2, total_tokens=5))
    wire = msgspec.json.decode(encode(r))
    assert [f for f in REQUIRED if f not in wire] == []
    assert [f for f in NON_NULL if wire[f] is None] == []
    assert re.fullmatch(r"resp_[0-9a-f]{48}", r.id) and wire["object"] == "response" and wire["status"] == "in_progress"
    assert wire["text"] == {"format": {"type": "text"}} and wire["tool_choice"] == "auto" and wire["tools"] == []
    assert wire["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert wire["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert decode_response(encode(r)) == r and not r.terminal
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    structured = Response(
        model="m", status="completed", text=TextConfig(format=JsonSchemaFormat(name="s", schema=schema))
    )
    assert decode_response(encode(structured)) == structured and structured.terminal
    conv = msgspec.json.decode(encode(Conversation(id=new_id("conv"), created_at=1)))
    assert conv == {"id": conv["id"], "object": "conversation", "created_at": 1, "metadata": {}}
    assert len({new_id("msg") for _ in range(1000)}) == 1000
