"""Tool definitions and JSON schemas checked up front; produced arguments checked after;
the 60 real-world schemas of JSONSchemaBench compile (all but the two the README names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.structured_demo import compiler
from tools.grammar import GrammarCompiler
from tools.schema import (
    ArgumentsInvalid,
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


@pytest.mark.parametrize(
    ("tools", "needle"),
    [
        ([_tool("bad name!")], "tools[0]: name 'bad name!'"),
        ([_tool("")], "tools[0]: name ''"),
        ([_tool("f"), _tool("f")], "tools[1]: duplicate tool name 'f'"),
        ([{"type": "code_interpreter"}], "tools[0]: only function tools"),
        ([{"type": "function"}], "tools[0]: missing 'function'"),
    ],
)
def test_malformed_tool_is_rejected(tools: list[dict[str, Any]], needle: str) -> None:
    with pytest.raises(InvalidTool, match=None) as e:
        parse_tools(tools)
    assert needle in str(e.value)


def test_invalid_schema_names_tool_and_path() -> None:
    bad = {"type": "object", "properties": {"city": {"type": "strin"}}}
    with pytest.raises(InvalidSchema) as e:
        parse_tools([_tool("get_weather", bad)])
    assert e.value.where == "tool 'get_weather' parameters"
    assert e.value.path == "$.properties.city.type"
    assert "get_weather" in str(e.value) and "$.properties.city.type" in str(e.value)
    with pytest.raises(InvalidSchema, match="arguments must be an object"):
        parse_tools([_tool("f", {"type": "array"})])


def test_schema_the_grammar_cannot_express_names_the_tool(gc: GrammarCompiler) -> None:
    # Valid JSON Schema, but xgrammar cannot represent an integer bound beyond 64 bits.
    huge = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**30}}}
    tools = parse_tools([_tool("ok", CITY), _tool("count", huge)])
    with pytest.raises(InvalidSchema) as e:
        gc.check_tools(tools)
    assert e.value.where == "tool 'count' parameters"
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
    assert len(files) == 60, "the README promises 60 schemas"
    rejected: dict[str, str] = {}
    for f in files:
        try:
            gc.json_schema(json.loads(f.read_text()), where=f.name)
        except InvalidSchema as e:
            rejected[f"{f.parent.name}/{f.name}"] = str(e)
    assert set(rejected) == set(UNCOMPILABLE)
    for name, needle in UNCOMPILABLE.items():
        assert needle in rejected[name] and Path(name).name in rejected[name]
