"""What a request asks its reply to be: `tool_choice` and the output format, in either API's shape.

Chat Completions and the Responses API say the same things in different shapes; both are parsed
into one `ToolChoice` and one `OutputFormat`, which `tools.formats` and `tools.grammar` build
grammars from:

    tool_choice  "none" | "auto" | "required"
                 {"type": "function", "function": {"name": "f"}}                         (Chat)
                 {"type": "function", "name": "f"}                                       (Responses)
                 {"type": "allowed_tools", "allowed_tools": {"mode", "tools": [...]}}    (Chat)
                 {"type": "allowed_tools", "mode", "tools": [...]}                       (Responses)
    format       response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (Chat)
                 text.format {"type": "json_schema", "name", "schema", "strict"}         (Responses)
                 {"type": "json_object"} | {"type": "text"}                              (both)

A tool_choice is checked against the declared tools here (a name must be declared; `required` or a
named function needs tools), so a request that cannot be answered fails before any decoding. Errors
are `InvalidToolChoice` / `InvalidOutputFormat` with the offending field's path as `param`.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from tools.schema import HOSTED_TOOLS, InvalidOutputFormat, InvalidToolChoice, ToolSpec

Mode = Literal["none", "auto", "required"]
FormatKind = Literal["text", "json_object", "json_schema"]


class ToolChoice(NamedTuple):
    """Whether the reply may, must or must not call tools, and which.

    Attributes:
        mode: none (no calls), auto (text or calls), required (calls only, at least one).
        names: the tools it may call (a named function, or `allowed_tools`); None = every declared one.
        single: exactly one call (a named function).
    """

    mode: Mode
    names: tuple[str, ...] | None = None
    single: bool = False

    def allowed(self, tools: list[ToolSpec]) -> list[ToolSpec]:
        """The declared tools this choice lets the reply call, in declaration order."""
        if self.mode == "none":
            return []
        return tools if self.names is None else [t for t in tools if t.name in self.names]


def parse_tool_choice(tool_choice: Any, tools: list[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """A request's `tool_choice` (None = auto) in either API's shape, checked against its tools.

    Raises:
        InvalidToolChoice: an unknown value or type; `required`, a named function or allowed tools
            without declared tools; a name that is not declared.
    """
    declared = {t.name for t in tools}
    if isinstance(tool_choice, ToolChoice):
        choice = tool_choice
        for name in choice.names or ():
            _check_declared(name, param, declared)
    elif tool_choice is None or tool_choice in ("none", "auto", "required"):
        choice = ToolChoice(tool_choice or "auto")
    elif isinstance(tool_choice, dict):
        choice = _parse_choice_object(tool_choice, param, declared)
    else:
        raise InvalidToolChoice(param, f"expected none, auto, required or a function, got {tool_choice!r}")
    if choice.mode == "required" and not tools:
        raise InvalidToolChoice(param, "requires tool calls, but the request declares no tools")
    return choice


def _check_declared(name: str, param: str, declared: set[str]) -> None:
    if not declared:
        raise InvalidToolChoice(param, f"names function {name!r}, but the request declares no tools")
    if name not in declared:
        raise InvalidToolChoice(param, f"function {name!r} is not among the declared tools")


def _qualified(obj: dict[str, Any]) -> str | None:
    """A choice entry's tool name, qualified by its `namespace` when it gives one."""
    name, space = obj.get("name"), obj.get("namespace")
    if not isinstance(name, str):
        return None
    return f"{space}.{name}" if isinstance(space, str) and space else name


def _parse_choice_object(obj: dict[str, Any], param: str, declared: set[str]) -> ToolChoice:
    kind = obj.get("type")
    if kind in ("function", "custom"):
        if "function" in obj:  # Chat
            fn = obj["function"]
            name, at = (fn.get("name") if isinstance(fn, dict) else None), f"{param}.function.name"
        else:  # Responses (a namespace's tool by its qualified name, or with its namespace)
            name, at = _qualified(obj), f"{param}.name"
        if not isinstance(name, str):
            raise InvalidToolChoice(at, f"expected the function's name, got {name!r}")
        _check_declared(name, at, declared)
        return ToolChoice("required", (name,), single=True)
    if kind == "allowed_tools":
        inner, at = (obj["allowed_tools"], f"{param}.allowed_tools") if "allowed_tools" in obj else (obj, param)
        if not isinstance(inner, dict):
            raise InvalidToolChoice(at, "expected an object with 'mode' and 'tools'")
        mode, listed = inner.get("mode", "auto"), inner.get("tools")
        if mode not in ("auto", "required"):
            raise InvalidToolChoice(f"{at}.mode", f"expected auto or required, got {mode!r}")
        if not isinstance(listed, list) or not listed:
            raise InvalidToolChoice(f"{at}.tools", f"expected a non-empty list of tools, got {listed!r}")
        names = []
        for i, t in enumerate(listed):
            if isinstance(t, dict) and t.get("type") in HOSTED_TOOLS:
                continue  # a hosted tool is never offered here
            kind_i = t.get("type", "function") if isinstance(t, dict) else None
            fn = t.get("function", t) if kind_i in ("function", "custom") else None
            name = _qualified(fn) if isinstance(fn, dict) else None
            if name is None:
                raise InvalidToolChoice(
                    f"{at}.tools[{i}]", f"expected a function or custom tool with its name, got {t!r}"
                )
            _check_declared(name, f"{at}.tools[{i}]", declared)
            names.append(name)
        return ToolChoice(mode, tuple(names))
    raise InvalidToolChoice(f"{param}.type", f"tool_choice type {kind!r} is not supported; only function tools are")


class OutputFormat(NamedTuple):
    """The reply's text format.

    Attributes:
        kind: text (free), json_object (any JSON object) or json_schema.
        schema: the JSON Schema (json_schema only).
        name: the schema's name ("" when none was given).
        strict: as the request said; the grammar always holds to the schema.
        param: the request field it came from (`response_format`, `text.format`).
        schema_param: where in the request the schema is (`text.format.schema`), for schema errors.
    """

    kind: FormatKind = "text"
    schema: Any = None
    name: str = ""
    strict: bool | None = None
    param: str = "response_format"
    schema_param: str = ""


def parse_output_format(spec: Any, param: str = "response_format") -> OutputFormat:
    """Chat's `response_format` or the Responses API's `text.format` (`param` says which field it is).

    Raises:
        InvalidOutputFormat: not an object, an unknown type, or a json_schema without its schema.
    """
    if isinstance(spec, OutputFormat) or spec is None:
        return spec or OutputFormat(param=param)
    if not isinstance(spec, dict):
        raise InvalidOutputFormat(param, f"expected an object with a 'type', got {spec!r}")
    kind = spec.get("type", "text")
    if kind in ("text", "json_object"):
        return OutputFormat(kind, param=param)
    if kind != "json_schema":
        raise InvalidOutputFormat(f"{param}.type", f"unknown type {kind!r}; expected text, json_object or json_schema")
    # Chat nests the schema under "json_schema"; Responses puts it beside "type". With neither
    # there, the error names the field the API given by `param` expects.
    if "json_schema" in spec:
        chat = True
    elif "schema" in spec or "name" in spec:
        chat = False
    else:
        chat = param.endswith("response_format")
    body, at = (spec.get("json_schema"), f"{param}.json_schema") if chat else (spec, param)
    if not isinstance(body, dict):
        raise InvalidOutputFormat(at, "a json_schema format needs an object with 'name' and 'schema'")
    if body.get("schema") is None:
        raise InvalidOutputFormat(f"{at}.schema", "a json_schema format needs its JSON Schema")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidOutputFormat(f"{at}.strict", f"expected true, false or null, got {strict!r}")
    name = str(body.get("name") or "")
    return OutputFormat("json_schema", body["schema"], name, strict, param, f"{at}.schema")
