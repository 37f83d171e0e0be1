"""tool_choice and the output format in both APIs' shapes, and the errors (with `param`) for the
ones a request cannot have."""

from __future__ import annotations

from typing import Any

import pytest

from tools.constraints import OutputFormat, ToolChoice, parse_output_format, parse_tool_choice
from tools.schema import InvalidOutputFormat, InvalidRequest, InvalidToolChoice, parse_tools

TOOLS = parse_tools([{"type": "function", "name": "add"}, {"type": "function", "name": "get_weather"}])
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, ToolChoice("auto")),
        ("auto", ToolChoice("auto")),
        ("none", ToolChoice("none")),
        ("required", ToolChoice("required")),
        ({"type": "function", "function": {"name": "add"}}, ToolChoice("required", ("add",), single=True)),
        ({"type": "function", "name": "add"}, ToolChoice("required", ("add",), single=True)),
        (
            {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]},
            ToolChoice("required", ("get_weather",)),
        ),
        (
            {
                "type": "allowed_tools",
                "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "add"}}]},
            },
            ToolChoice("auto", ("add",)),
        ),
    ],
)
def test_tool_choice_in_both_shapes(choice: Any, expected: ToolChoice) -> None:
    assert parse_tool_choice(choice, TOOLS) == expected


def test_allowed_restricts_the_tools() -> None:
    assert ToolChoice("auto").allowed(TOOLS) == TOOLS
    assert ToolChoice("none").allowed(TOOLS) == []
    assert [t.name for t in ToolChoice("required", ("get_weather",)).allowed(TOOLS)] == ["get_weather"]


@pytest.mark.parametrize(
    ("choice", "tools", "param", "needle"),
    [
        ("required", [], "tool_choice", "requires tool calls, but the request declares no tools"),
        ({"type": "function", "name": "add"}, [], "tool_choice.name", "the request declares no tools"),
        ({"type": "function", "function": {"name": "sub"}}, TOOLS, "tool_choice.function.name", "'sub' is not among"),
        ({"type": "function", "name": "sub"}, TOOLS, "tool_choice.name", "'sub' is not among the declared tools"),
        ({"type": "function"}, TOOLS, "tool_choice.name", "expected the function's name"),
        ({"type": "file_search"}, TOOLS, "tool_choice.type", "type 'file_search' is not supported"),
        ({"type": "web_search_preview"}, TOOLS, "tool_choice.type", "type 'web_search_preview' is not supported"),
        ("always", TOOLS, "tool_choice", "expected none, auto, required or a function"),
        ({"type": "allowed_tools", "mode": "none", "tools": []}, TOOLS, "tool_choice.mode", "auto or required"),
        ({"type": "allowed_tools", "mode": "auto", "tools": []}, TOOLS, "tool_choice.tools", "non-empty list"),
        (
            {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "sub"}]},
            TOOLS,
            "tool_choice.tools[0]",
            "'sub' is not among",
        ),
    ],
)
def test_bad_tool_choice_names_its_field(choice: Any, tools: list[Any], param: str, needle: str) -> None:
    with pytest.raises(InvalidToolChoice) as e:
        parse_tool_choice(choice, tools)
    assert e.value.param == param and isinstance(e.value, InvalidRequest)
    assert str(e.value).startswith(f"{param}: ") and needle in str(e.value)


def test_output_format_in_both_shapes() -> None:
    chat = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    flat = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    assert parse_output_format(chat) == OutputFormat(
        "json_schema", SCHEMA, "answer", True, "response_format", "response_format.json_schema.schema"
    )
    assert parse_output_format(flat, "text.format") == OutputFormat(
        "json_schema", SCHEMA, "answer", True, "text.format", "text.format.schema"
    )
    assert parse_output_format({"type": "json_object"}, "text.format").kind == "json_object"
    assert parse_output_format({"type": "text"}) == parse_output_format(None) == OutputFormat()


@pytest.mark.parametrize(
    ("spec", "param", "expected", "needle"),
    [
        ({"type": "json_schema", "name": "a"}, "text.format", "text.format.schema", "needs its JSON Schema"),
        ({"type": "json_schema"}, "text.format", "text.format.schema", "needs its JSON Schema"),
        ({"type": "json_schema"}, "response_format", "response_format.json_schema", "needs an object"),
        (
            {"type": "json_schema", "json_schema": {"name": "a"}},
            "response_format",
            "response_format.json_schema.schema",
            "needs its JSON Schema",
        ),
        ({"type": "xml"}, "response_format", "response_format.type", "unknown type 'xml'"),
        ("json", "text.format", "text.format", "expected an object"),
        ({"type": "json_schema", "schema": SCHEMA, "strict": 1}, "text.format", "text.format.strict", "true, false"),
    ],
)
def test_bad_output_format_names_its_field(spec: Any, param: str, expected: str, needle: str) -> None:
    with pytest.raises(InvalidOutputFormat) as e:
        parse_output_format(spec, param)
    assert e.value.param == expected and str(e.value).startswith(f"{expected}: ") and needle in str(e.value)
