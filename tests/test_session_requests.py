"""`POST /v1/responses` bodies: what the OpenAI Agents SDK sends is accepted (unknown fields, nulls,
flat tools, re-sent output items), and each bad field fails with its path as `param`."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sessions.items import FunctionCall, FunctionCallOutput, Message
from sessions.models import JsonSchemaFormat
from sessions.requests import InvalidParam, decode_request

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}  # fmt: skip


def test_sdk_body_is_accepted_and_echoed() -> None:
    body = {
        "model": "demo", "instructions": "Be brief.", "include": [], "tools": [WEATHER], "temperature": 0.5,
        "max_output_tokens": None, "tool_choice": None, "stream": False, "unknown_field": {"x": 1},
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "status": "completed", "created_at": 1},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        ],
        "text": {"format": {"type": "json_schema", "name": "answer", "strict": True,
                            "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}},
    }  # fmt: skip
    req = decode_request(msgspec.json.encode(body))
    assert [type(i) for i in req.input_items] == [Message, FunctionCall, FunctionCallOutput]
    assert req.store and not req.stream and not req.background and req.thinking
    assert req.tool_choice == "auto" and req.tools[0]["name"] == "get_weather" and req.tools[0]["strict"] is True
    assert isinstance(req.text.format, JsonSchemaFormat) and req.text.format.name == "answer"
    assert req.response_format() == {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": body["text"]["format"]["schema"],  # type: ignore[index]
                                               "strict": True},
    }  # fmt: skip
    response = req.response("demo", 64)
    assert response.status == "in_progress" and response.instructions == "Be brief." and response.temperature == 0.5
    assert response.tools[0]["description"] == "Weather of a city" and response.max_output_tokens == 64


def test_tool_choice_shapes() -> None:
    choice = {"type": "function", "name": "get_weather"}
    named = decode_request({"input": "x", "tools": [WEATHER], "tool_choice": choice})
    assert named.tool_choice == {"type": "function", "name": "get_weather"}
    assert decode_request({"input": "x", "tools": [WEATHER], "tool_choice": "required"}).tool_choice == "required"
    off = decode_request({"input": "x", "reasoning": {"effort": "none"}, "conversation": {"id": "conv_1"}})
    assert not off.thinking and off.conversation_id == "conv_1"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
        ({"input": "x", "tools": [{"type": "oracle"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER, {"type": "function", "name": "get_weather"}]}, "tools[1].name"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "top_p": 0}, "top_p"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
        ({}, "input"),
        ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"input": "x", "context_management": [{"type": "summary"}]}, "context_management[0].type"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_fields_name_their_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParam) as e:
        decode_request(msgspec.json.encode(body))
    assert e.value.param.startswith(param), e.value


def test_malformed_json_is_invalid_param() -> None:
    with pytest.raises(InvalidParam) as e:
        decode_request(b'{"input": ')
    assert e.value.param == "body"
