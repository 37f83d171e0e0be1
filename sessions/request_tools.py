"""The tool and output-format fields of `POST /v1/responses`, checked in the Responses API's flat
shapes: `tools` (function tools only; OpenAI's hosted tool types are named as unsupported),
`tool_choice` (none, auto, required, or `{"type": "function", "name"}`; Chat's nested shape is
read too) and `text` (`format`: text, json_object, or json_schema with its schema). Failures are
`InvalidParam` naming the field's path.
"""

from __future__ import annotations

from typing import Any

from sessions.errors import InvalidParam
from sessions.models import (
    FunctionTool,
    JsonObjectFormat,
    JsonSchemaFormat,
    TextConfig,
    TextFormat,
    TextFormatText,
    ToolChoice,
    ToolChoiceFunction,
)

# Tool types of OpenAI's hosted tools: named in the error, since only function tools run here.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "mcp", "code_interpreter", "computer_use_preview", "computer_use", "image_generation", "local_shell",
    "shell", "apply_patch", "custom",
})  # fmt: skip


def parse_tools(raw: list[Any]) -> list[FunctionTool]:
    tools: list[FunctionTool] = []
    seen: set[str] = set()
    for i, t in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidParam(at, "a tool must be an object")
        kind = t.get("type", "function")
        if kind in HOSTED_TOOLS:
            raise InvalidParam(f"{at}.type", f"tool type {kind!r} is not supported: function tools only")
        if kind != "function":
            raise InvalidParam(f"{at}.type", f"unknown tool type {kind!r}; only function tools are supported")
        fn = t["function"] if isinstance(t.get("function"), dict) else t  # the Chat shape, leniently
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParam(f"{at}.name", "a function tool needs its name")
        if name in seen:
            raise InvalidParam(f"{at}.name", f"duplicate tool name {name!r}")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidParam(f"{at}.parameters", "expected a JSON Schema object")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidParam(f"{at}.strict", f"expected true, false or null, got {strict!r}")
        desc = fn.get("description")
        tools.append(FunctionTool(name=name, description=desc if isinstance(desc, str) else None,
                                  parameters=params, strict=strict))  # fmt: skip
    return tools


def parse_tool_choice(raw: Any, tools: list[FunctionTool]) -> ToolChoice:
    if raw is None:
        return "auto"
    if raw in ("none", "auto"):
        return raw  # type: ignore[no-any-return]
    if raw == "required":
        if not tools:
            raise InvalidParam("tool_choice", "'required' needs tools, but the request declares none")
        return "required"
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        if isinstance(fn, dict):
            name, at = fn.get("name"), "tool_choice.function.name"
        else:
            name, at = raw.get("name"), "tool_choice.name"
        if not isinstance(name, str):
            raise InvalidParam(at, "expected the function's name")
        if name not in {t.name for t in tools}:
            raise InvalidParam(at, f"function {name!r} is not among the declared tools")
        return ToolChoiceFunction(name=name)
    if isinstance(raw, dict) and raw.get("type") in HOSTED_TOOLS:
        raise InvalidParam("tool_choice.type", f"tool type {raw['type']!r} is not supported: function tools only")
    raise InvalidParam("tool_choice", f"expected none, auto, required or a function, got {raw!r}")


def parse_text(raw: dict[str, Any] | None) -> TextConfig:
    if raw is None:
        return TextConfig()
    fmt = raw.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidParam("text.format", "expected an object with a 'type'")
    kind = (fmt or {}).get("type", "text")
    parsed: TextFormat
    if kind == "text":
        parsed = TextFormatText()
    elif kind == "json_object":
        parsed = JsonObjectFormat()
    elif kind == "json_schema":
        assert fmt is not None
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidParam("text.format.schema", "a json_schema format needs its JSON Schema (an object)")
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParam("text.format.name", "a json_schema format needs a name")
        strict = fmt.get("strict")
        desc = fmt.get("description")
        parsed = JsonSchemaFormat(name=name, schema=fmt["schema"], strict=strict if isinstance(strict, bool) else None)
        if isinstance(desc, str):
            parsed.description = desc
    else:
        raise InvalidParam("text.format.type", f"unknown type {kind!r}; expected text, json_object or json_schema")
    verbosity = raw.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise InvalidParam("text.verbosity", f"expected low, medium or high, got {verbosity!r}")
    text = TextConfig(format=parsed)
    if verbosity is not None:
        text.verbosity = verbosity
    return text
