"""The tool and output-format fields of `POST /v1/responses`, checked in the Responses API's flat
shapes and normalised into what a response echoes: `tools` (function, custom and namespace tools
as `tools.schema.parse_tools` reads them; hosted tools echoed as sent, whatever the server's
`--hosted-tools` policy does with them), `tool_choice` (none, auto, required, a function or custom
tool, `allowed_tools`; Chat's nested shape is read too) and `text` (`format`: text, json_object,
or json_schema with its schema; `verbosity`). Failures are `InvalidParam` naming the field's path.
"""

from __future__ import annotations

from typing import Any

from sessions.errors import InvalidParam
from sessions.models import JsonObjectFormat, JsonSchemaFormat, TextConfig, TextFormat, TextFormatText
from tools.constraints import parse_tool_choice as check_tool_choice
from tools.schema import HOSTED_TOOLS, InvalidRequest, ToolSpec
from tools.schema import parse_tools as tool_specs


def parse_tools(raw: list[Any]) -> tuple[list[dict[str, Any]], list[ToolSpec]]:
    """The echo of `tools` (each definition checked, normalised with every field present) and
    the tools the model may be offered (hosted ones left out)."""
    try:
        specs = tool_specs(raw, hosted="ignore")
    except InvalidRequest as e:
        raise InvalidParam(e.param, str(e).removeprefix(f"{e.param}: ")) from None
    by_param = iter(specs)
    echoed: list[dict[str, Any]] = []
    for t in raw:
        kind = t.get("type", "function")
        if kind in HOSTED_TOOLS:
            echoed.append(dict(t))
        elif kind == "namespace":
            inner = [next(by_param).responses() for _ in t["tools"]]
            echoed.append({"type": "namespace", "name": t["name"], "description": t.get("description"), "tools": inner})
        else:
            echoed.append(next(by_param).responses())
    return echoed, specs


def parse_tool_choice(raw: Any, tools: list[ToolSpec]) -> str | dict[str, Any]:
    """The echo of `tool_choice` (missing: auto), checked against the declared tools."""
    if raw is None:
        return "auto"
    if isinstance(raw, dict) and raw.get("type") in HOSTED_TOOLS:
        raise InvalidParam("tool_choice.type", f"hosted tool type {raw['type']!r} cannot run on this server")
    try:
        check_tool_choice(raw, tools)
    except InvalidRequest as e:
        raise InvalidParam(e.param, str(e).removeprefix(f"{e.param}: ")) from None
    if isinstance(raw, str):
        return raw
    if raw.get("type") == "function" and isinstance(raw.get("function"), dict):  # Chat's nested shape
        return {"type": "function", "name": raw["function"].get("name")}
    return dict(raw)


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
