"""Tool definitions and JSON schemas checked up front; produced arguments checked after;
the 60 real-world schemas of JSONSchemaBench compile (all but the two `UNCOMPILABLE` names; docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.structured_demo import compiler
from tools.grammar import GrammarCompiler
from tools.schema import (
    ArgumentsInvalid,
    InvalidRequest,
    InvalidSchema,
    InvalidTool,
    clean_compiler_message,
    parse_tools,
    validate_arguments,
)

BENCH = Path(__file__).resolve().parent / "data" / "jsonschemabench"
UNCOMPILABLE = {"Github_hard/o19336.json": "minItems", "Snowplow/sp_18_Normalized.json": "Integer exceeds"}
CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}}, "required": ["city"]}


def _tool(name: Any, parameters: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


@pytest.fixture(scope="module")
def gc(demo_gguf: Path) -> GrammarCompiler:
    return compiler(str(demo_gguf))


def test_parse_tools_accepts_openai_shape() -> None:
    (spec,) = parse_tools([_tool("get_weather", CITY)])
    assert spec.name == "get_weather" and spec.parameters == CITY
    assert spec.openai()["function"]["parameters"] == CITY
    (bare,) = parse_tools([_tool("now")])
    assert bare.parameters == {"type": "object", "properties": {}}


def test_parse_tools_accepts_responses_shape() -> None:
    flat = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY, "strict": True}
    (spec,) = parse_tools([flat])
    assert (spec.name, spec.parameters, spec.description, spec.strict) == ("get_weather", CITY, "Weather", True)
    chat = {"type": "function", "function": {k: v for k, v in flat.items() if k != "type"}}
    assert parse_tools([chat]) == [spec], "both shapes give the same tool"
    assert spec.param == "tools[0].parameters"
    assert spec.responses() == flat
    assert spec.openai() == {"type": "function", "function": {"name": "get_weather", "parameters": CITY,
                                                             "description": "Weather"}}  # fmt: skip
    (bare,) = parse_tools([{"type": "function", "name": "now", "parameters": None, "strict": None}])
    assert bare.parameters == {"type": "object", "properties": {}}
    assert bare.responses() == {"type": "function", "name": "now", "description": None,
                                "parameters": bare.parameters, "strict": None}  # fmt: skip


@pytest.mark.parametrize(
    "kind",
    ["web_search", "web_search_preview", "file_search", "mcp", "code_interpreter", "computer_use_preview",
     "image_generation", "local_shell"],
)  # fmt: skip
def test_hosted_tools_are_rejected_by_name_or_ignored(kind: str) -> None:
    with pytest.raises(InvalidTool) as e:
        parse_tools([_tool("ok"), {"type": kind}])
    assert e.value.param == "tools[1].type"
    assert str(e.value) == f"tools[1].type: hosted tool type {kind!r} cannot run on this server"
    assert [t.name for t in parse_tools([_tool("ok"), {"type": kind}], hosted="ignore")] == ["ok"]


def test_namespace_and_custom_tools() -> None:
    lark = {"type": "grammar", "syntax": "lark", "definition": 'start: "a"+'}
    specs = parse_tools([
        {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
         "tools": [_tool("spawn_agent"), {"type": "custom", "name": "note", "format": lark}]},
        {"type": "custom", "name": "apply_patch"},
    ])  # fmt: skip
    assert [(t.name, t.namespace, t.local_name, t.kind) for t in specs] == [
        ("multi_agent_v1.spawn_agent", "multi_agent_v1", "spawn_agent", "function"),
        ("multi_agent_v1.note", "multi_agent_v1", "note", "custom"),
        ("apply_patch", None, "apply_patch", "custom"),
    ]
    assert specs[1].format == lark and specs[2].format == {"type": "text"}
    assert specs[1].responses() == {"type": "custom", "name": "note", "description": None, "format": lark}
    with pytest.raises(InvalidTool) as e:
        parse_tools([{"type": "custom", "name": "r", "format": {"type": "grammar", "syntax": "regex",
                                                                "definition": "(unclosed"}}])  # fmt: skip
    assert e.value.param == "tools[0].format.definition"


@pytest.mark.parametrize(
    ("tools", "param", "needle"),
    [
        ([_tool("bad name!")], "tools[0].function.name", "'bad name!' must be 1-64 characters"),
        ([{"type": "function", "name": ""}], "tools[0].name", "'' must be 1-64 characters"),
        ([_tool("f"), _tool("f")], "tools[1].function.name", "duplicate tool name 'f'"),
        ([{"type": "function"}], "tools[0].name", "needs its name"),
        ([{"type": "function", "function": "f"}], "tools[0].function", "expected an object"),
        (["f"], "tools[0]", "a tool must be an object"),
        ([{"type": "function", "name": "f", "strict": "yes"}], "tools[0].strict", "expected true, false or null"),
    ],
)
def test_malformed_tool_is_rejected(tools: list[Any], param: str, needle: str) -> None:
    with pytest.raises(InvalidTool) as e:
        parse_tools(tools)
    assert e.value.param == param and str(e.value).startswith(f"{param}: ") and needle in str(e.value)


def test_invalid_schema_names_tool_and_path() -> None:
    bad = {"type": "object", "properties": {"city": {"type": "strin"}}}
    with pytest.raises(InvalidSchema) as e:
        parse_tools([_tool("get_weather", bad)])
    assert e.value.where == "tool 'get_weather' parameters"
    assert e.value.path == "$.properties.city.type"
    assert e.value.param == "tools[0].function.parameters" and isinstance(e.value, InvalidRequest)
    assert "get_weather" in str(e.value) and "$.properties.city.type" in str(e.value)
    with pytest.raises(InvalidSchema, match="arguments must be an object") as e:
        parse_tools([_tool("g"), {"type": "function", "name": "f", "parameters": {"type": "array"}}])
    assert e.value.param == "tools[1].parameters"


def test_schema_the_grammar_cannot_express_names_the_tool(gc: GrammarCompiler) -> None:
    # Valid JSON Schema, but xgrammar cannot represent an integer bound beyond 64 bits.
    huge = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**30}}}
    tools = parse_tools([_tool("ok", CITY), _tool("count", huge)])
    with pytest.raises(InvalidSchema) as e:
        gc.check_tools(tools)
    assert e.value.where == "tool 'count' parameters" and e.value.param == "tools[1].function.parameters"
    assert "Integer exceeds" in e.value.reason and "/project/" not in e.value.reason


def test_arguments_validated_with_json_path() -> None:
    (spec,) = parse_tools([_tool("get_weather", CITY)])
    assert validate_arguments(spec, '{"city": "Paris"}') == {"city": "Paris"}
    with pytest.raises(ArgumentsInvalid) as e:
        validate_arguments(spec, '{"city": "P"}')
    assert e.value.tool == "get_weather" and e.value.path == "$.city"
    with pytest.raises(ArgumentsInvalid, match="not JSON"):
        validate_arguments(spec, '{"city": ')


def test_clean_compiler_message() -> None:
    raw = "[11:44:46] /project/cpp/json_schema_converter.cc:967: Check failed: (false) is false: Integer too big\n"
    assert clean_compiler_message(raw) == "Integer too big"


def test_jsonschemabench_compiles(gc: GrammarCompiler) -> None:
    files = sorted(BENCH.glob("*/*.json"))
    assert len(files) == 60, "docs/benchmarks.md promises 60 schemas"
    rejected: dict[str, str] = {}
    for f in files:
        try:
            gc.json_schema(json.loads(f.read_text()), where=f.name)
        except InvalidSchema as e:
            rejected[f"{f.parent.name}/{f.name}"] = str(e)
    assert set(rejected) == set(UNCOMPILABLE)
    for name, needle in UNCOMPILABLE.items():
        assert needle in rejected[name] and Path(name).name in rejected[name]
