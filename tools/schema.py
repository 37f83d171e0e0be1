"""Tool definitions and JSON schemas: checked once when a request arrives, and arguments checked after.

Two checks up front, because a bad schema found mid-generation would waste the whole decode:
the schema must be valid JSON Schema (draft 2020-12, `jsonschema`), and the grammar engine must be
able to express it (xgrammar's compiler, called by `tools.grammar`). Both failures raise
`InvalidSchema`, naming the tool and the offending part. After a call is produced, its arguments
are validated against the same schema; a failure names the tool and the JSON path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " and "Check failed: ... : ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false: )?")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class InvalidSchema(ValueError):
    """A schema the server cannot accept: invalid JSON Schema, or beyond what the grammar engine expresses.

    Attributes:
        where: what the schema belongs to (`tool 'get_weather'`, `response_format`).
        path: JSON path of the offending part inside the schema (`$.properties.city`), or `$`.
        reason: the validator's or the grammar compiler's message.
    """

    def __init__(self, where: str, path: str, reason: str):
        self.where, self.path, self.reason = where, path, reason
        super().__init__(f"{where}: invalid schema at {path}: {reason}")


class InvalidTool(ValueError):
    """A tool definition that is malformed apart from its schema (missing or bad name, wrong shape)."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One declared function tool: its name and the JSON Schema of its arguments."""

    name: str
    parameters: dict[str, Any]
    description: str = ""

    def openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions shape (what xgrammar and chat templates take)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ArgumentsInvalid(ValueError):
    """Arguments that are not JSON, or do not satisfy the tool's schema."""

    def __init__(self, tool: str, path: str, reason: str):
        self.tool, self.path, self.reason = tool, path, reason
        super().__init__(f"tool {tool!r}: arguments invalid at {path}: {reason}")


def clean_compiler_message(message: str) -> str:
    """xgrammar's C++ error without its timestamp, source location and assertion text."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(message).strip().splitlines()]
    return " ".join(line for line in lines if line)


def check_json_schema(schema: Any, where: str) -> dict[str, Any]:
    """Checks that `schema` is a valid draft 2020-12 JSON Schema object; returns it.

    Raises:
        InvalidSchema: naming `where` and the path of the bad keyword.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidSchema(where, "$", f"not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidSchema(where, "$", f"a schema must be a JSON object, got {type(schema).__name__}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise InvalidSchema(where, e.json_path, e.message) from None
    return schema


def parse_tools(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    """Validates OpenAI-shape tool definitions (`{"type": "function", "function": {...}}`).

    Only the JSON Schema check happens here; whether the grammar engine can express each schema is
    checked when the grammar is compiled (`tools.grammar.GrammarCompiler.check_tools`).

    Raises:
        InvalidTool: a malformed definition or a duplicate name.
        InvalidSchema: a tool's `parameters` is not a valid JSON Schema object schema.
    """
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidTool(f"tools[{i}]: only function tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidTool(f"tools[{i}]: missing 'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidTool(f"tools[{i}]: name {name!r} must be 1-64 characters of letters, digits, _ . : -")
        if name in seen:
            raise InvalidTool(f"tools[{i}]: duplicate tool name {name!r}")
        seen.add(name)
        where = f"tool {name!r} parameters"
        params = check_json_schema(fn.get("parameters", EMPTY_PARAMETERS), where)
        if params.get("type", "object") != "object":
            raise InvalidSchema(where, "$.type", f"arguments must be an object, got type {params.get('type')!r}")
        specs.append(ToolSpec(name, params, str(fn.get("description", ""))))
    return specs


def validate_instance(instance: Any, schema: dict[str, Any]) -> tuple[str, str] | None:
    """The first violation of `schema` by `instance` as (JSON path, message), or None when valid.

    Formats are checked (`format_checker`), as a client validating the output would.
    """
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    error = next(iter(sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))), None)
    return None if error is None else (error.json_path, error.message)


def validate_arguments(tool: ToolSpec, arguments: str) -> Any:
    """Parses and validates a produced call's arguments; returns the parsed object.

    Raises:
        ArgumentsInvalid: naming the tool and the JSON path of the first violation.
    """
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ArgumentsInvalid(tool.name, "$", f"not JSON: {e}") from None
    error = validate_instance(value, tool.parameters)
    if error is not None:
        raise ArgumentsInvalid(tool.name, *error)
    return value
