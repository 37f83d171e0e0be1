"""Tool definitions and JSON schemas: checked once when a request arrives, and arguments checked after.

Two checks up front, because a bad schema found mid-generation would waste the whole decode:
the schema must be valid JSON Schema (draft 2020-12, `jsonschema`), and the grammar engine must be
able to express it (xgrammar's compiler, called by `tools.grammar`). Both failures raise
`InvalidSchema`, naming the tool and the offending part. After a call is produced, its arguments
are validated against the same schema; a failure names the tool and the JSON path.

Tools come in either API's shape: Chat Completions' `{"type": "function", "function": {...}}` or
the Responses API's flat `{"type": "function", "name", "description", "parameters", "strict"}`.
The Responses API adds custom tools (free-text input, `tools.custom`), namespace tools (their
tools offered as `namespace.name`) and hosted tools (`HOSTED_TOOLS`: left out or refused).
Every error about a request is an `InvalidRequest` whose `param` is the offending field's path in
that request (`tools[2].parameters`, `tool_choice`, `text.format.schema`), so that the HTTP layer
maps all of them to one 400 with `param`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from tools.custom import InvalidTool as CustomToolError
from tools.custom import check_format

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " and "Check failed: ... : ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false: )?")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# OpenAI's hosted tools: the server cannot run them (`--hosted-tools ignore|reject`).
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "mcp", "code_interpreter", "computer_use_preview", "computer_use", "image_generation", "local_shell",
    "shell", "apply_patch", "tool_search",
})  # fmt: skip
HostedPolicy = Literal["ignore", "reject"]


class InvalidRequest(ValueError):
    """A request field the server cannot accept.

    Attributes:
        param: the field's path in the request (`tools[2].function.name`, `tool_choice`).
    """

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(f"{param}: {message}")


class InvalidSchema(InvalidRequest):
    """A schema the server cannot accept: invalid JSON Schema, or beyond what the grammar engine expresses.

    Attributes:
        where: what the schema belongs to (`tool 'get_weather' parameters`, `response_format 'answer'`).
        path: JSON path of the offending part inside the schema (`$.properties.city`), or `$`.
        reason: the validator's or the grammar compiler's message.
        param: the schema's path in the request (`tools[0].parameters`, `text.format.schema`);
            `where` when the schema did not come from a request (a file given on the command line).
    """

    def __init__(self, where: str, path: str, reason: str, param: str | None = None):
        self.where, self.path, self.reason = where, path, reason
        ValueError.__init__(self, f"{where}: invalid schema at {path}: {reason}")
        self.param = param or where


class InvalidTool(InvalidRequest):
    """A tool definition that is malformed apart from its schema (unsupported type, bad name, wrong shape)."""


class InvalidToolChoice(InvalidRequest):
    """A `tool_choice` that is malformed, or names or needs tools the request does not declare."""


class InvalidOutputFormat(InvalidRequest):
    """A `response_format` / `text.format` that is malformed or of an unknown type."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One declared tool the model may call: a function (JSON arguments under a schema) or a
    custom tool (free-text input, optionally under a Lark or regex grammar: `tools.custom`).

    Attributes:
        name: the name the model calls it by; `namespace.local` for a tool of a namespace tool.
        strict: as the request said (None when it did not); the grammar always holds to the schema.
        param: where the request declared the parameters (`tools[1].parameters`), for errors.
        namespace: the namespace tool it was declared in (its calls carry it back), or None.
        kind: "function" or "custom".
        format: a custom tool's `format` ({"type": "text"} or a grammar), as checked.
    """

    name: str
    parameters: dict[str, Any]
    description: str = ""
    strict: bool | None = None
    param: str = field(default="", compare=False)
    namespace: str | None = None
    kind: Literal["function", "custom"] = "function"
    format: dict[str, Any] | None = None

    @property
    def local_name(self) -> str:
        """The name inside its namespace (the name itself outside one)."""
        return self.name.removeprefix(f"{self.namespace}.") if self.namespace else self.name

    def openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions shape (what xgrammar and chat templates take)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}

    def responses(self) -> dict[str, Any]:
        """The Responses API's flat shape, every field present (as a response object echoes it)."""
        if self.kind == "custom":
            return {
                "type": "custom",
                "name": self.local_name,
                "description": self.description or None,
                "format": self.format,
            }
        return {
            "type": "function",
            "name": self.local_name,
            "description": self.description or None,
            "parameters": self.parameters,
            "strict": self.strict,
        }


class ArgumentsInvalid(ValueError):
    """Arguments that are not JSON, or do not satisfy the tool's schema."""

    def __init__(self, tool: str, path: str, reason: str):
        self.tool, self.path, self.reason = tool, path, reason
        super().__init__(f"tool {tool!r}: arguments invalid at {path}: {reason}")


def clean_compiler_message(message: str) -> str:
    """xgrammar's C++ error without its timestamp, source location and assertion text."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(message).strip().splitlines()]
    return " ".join(line for line in lines if line)


def check_json_schema(schema: Any, where: str, param: str | None = None) -> dict[str, Any]:
    """Checks that `schema` is a valid draft 2020-12 JSON Schema object; returns it.

    Raises:
        InvalidSchema: naming `where` and the path of the bad keyword (`param`: the schema's field).
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidSchema(where, "$", f"not JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise InvalidSchema(where, "$", f"a schema must be a JSON object, got {type(schema).__name__}", param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise InvalidSchema(where, e.json_path, e.message, param) from None
    return schema


def parse_tools(tools: list[dict[str, Any]] | None, hosted: HostedPolicy = "reject") -> list[ToolSpec]:
    """Validates tool definitions in either API's shape (see the module docstring): function tools,
    custom tools, and namespace tools (`{"type": "namespace", "name", "tools": [...]}`, whose
    function and custom tools are offered as `namespace.name`).

    Only the JSON Schema check happens here; whether the grammar engine can express each schema is
    checked when the grammar is compiled (`tools.grammar.GrammarCompiler.check_tools`).

    Args:
        hosted: what a hosted tool (`web_search`, ...) gets: `ignore` (left out: the model is not
            offered it) or `reject` (InvalidTool naming `tools[i].type`).

    Raises:
        InvalidTool: an unknown tool type, a malformed definition or a duplicate name.
        InvalidSchema: a tool's `parameters` is not a valid JSON Schema object schema.
    """
    if tools is not None and not isinstance(tools, list):
        raise InvalidTool("tools", f"expected a list of tools, got {type(tools).__name__}")
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidTool(at, f"a tool must be an object, got {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind in HOSTED_TOOLS:
            if hosted == "reject":
                raise InvalidTool(f"{at}.type", f"hosted tool type {kind!r} cannot run on this server")
            continue
        if kind == "namespace":
            space = tool.get("name")
            if not isinstance(space, str) or not _NAME.match(space):
                raise InvalidTool(f"{at}.name", f"{space!r} must be 1-64 characters of letters, digits, _ . : -")
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise InvalidTool(f"{at}.tools", "a namespace tool needs a non-empty list of tools")
            for j, t in enumerate(inner):
                if not isinstance(t, dict) or t.get("type", "function") not in ("function", "custom"):
                    kind_j = t.get("type") if isinstance(t, dict) else type(t).__name__
                    raise InvalidTool(
                        f"{at}.tools[{j}].type", f"a namespace holds function and custom tools, got {kind_j!r}"
                    )
                specs.append(_tool(t, f"{at}.tools[{j}]", seen, space))
            continue
        specs.append(_tool(tool, at, seen))
    return specs


def _tool(tool: dict[str, Any], at: str, seen: set[str], namespace: str | None = None) -> ToolSpec:
    """One function or custom tool (of `namespace`, if given); its name is added to `seen`."""
    kind = tool.get("type", "function")
    if kind not in ("function", "custom"):
        raise InvalidTool(
            f"{at}.type",
            f"unknown tool type {kind!r}; supported: function, custom, namespace "
            "(hosted tools are ignored or rejected)",
        )
    if "function" in tool:  # Chat Completions
        fn, at = tool["function"], f"{at}.function"
        if not isinstance(fn, dict):
            raise InvalidTool(at, "expected an object with the function's name and parameters")
    elif "name" in tool:  # Responses
        fn = tool
    else:
        raise InvalidTool(f"{at}.name", "a tool needs its name: 'function' {name, parameters} or a flat 'name'")
    local = fn.get("name")
    name = f"{namespace}.{local}" if namespace is not None and isinstance(local, str) else local
    if not isinstance(local, str) or not isinstance(name, str) or not _NAME.match(name):
        raise InvalidTool(f"{at}.name", f"{name!r} must be 1-64 characters of letters, digits, _ . : -")
    if name in seen:
        raise InvalidTool(f"{at}.name", f"duplicate tool name {name!r}")
    seen.add(name)
    desc = str(fn.get("description") or "")
    if kind == "custom":
        try:
            fmt = check_format(tool.get("format"), f"{at}.format")
        except CustomToolError as e:
            raise InvalidTool(e.param, e.message) from None
        return ToolSpec(name, CUSTOM_PARAMETERS, desc, None, f"{at}.format", namespace, "custom", fmt)
    strict = fn.get("strict", tool.get("strict"))
    if strict is not None and not isinstance(strict, bool):
        raise InvalidTool(f"{at}.strict", f"expected true, false or null, got {strict!r}")
    where, param = f"tool {name!r} parameters", f"{at}.parameters"
    params = fn.get("parameters")
    params = check_json_schema(EMPTY_PARAMETERS if params is None else params, where, param)
    if params.get("type", "object") != "object":
        raise InvalidSchema(where, "$.type", f"arguments must be an object, got type {params.get('type')!r}", param)
    return ToolSpec(name, params, desc, strict, param, namespace)


# What a custom tool is offered as to templates that render tools: one free-text input.
CUSTOM_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"input": {"type": "string"}}}


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
