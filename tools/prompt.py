"""A conversation with tools to prompt ids: messages normalised first, then the chat template.

Chat templates are written for one shape of message, and requests arrive in several, so every
conversation is normalised before any template sees it:
- `content` is a string: None becomes "", a list of parts (`text`, `input_text`, `output_text`,
  `refusal`) is joined; a plain template concatenates `message['content']` and fails on anything else.
- An assistant's `tool_calls` are `{"id", "type": "function", "function": {"name", "arguments"}}`
  with `arguments` a dict: the Chat and Responses APIs carry them as a JSON string, and templates
  that render calls (Qwen2.5, Llama 3) apply `tojson` to them, which would quote the string again.
- `developer` (the Responses API's, and newer Chat clients') is `system`: the leading system and
  developer messages merge into one system message; a later developer message becomes a system
  one. Templates know no developer role (ChatML would add its default system prompt besides).

A template that renders `tools` itself is then used as it is; otherwise (the demo model's plain
ChatML) the conversation is rewritten Hermes style (`hermes_messages`), and `detect_format` says
Hermes for such a template.
"""

from __future__ import annotations

import json
from typing import Any

from engine.loading.tokenizer import Tokenizer
from tools import custom
from tools.formats import HERMES
from tools.schema import InvalidRequest, ToolSpec

TEXT_PARTS = ("text", "input_text", "output_text")

_HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def normalize_messages(messages: list[dict[str, Any]], param: str = "messages") -> list[dict[str, Any]]:
    """The conversation in the one shape templates take (see the module docstring); a new list.

    Raises:
        InvalidRequest: a message that is not an object, or a content part that is not text
            (`param` names it: `messages[2].content[0].type`).
    """
    out: list[dict[str, Any]] = []
    leading_system = True
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"{param}[{i}]", f"a message must be an object, got {type(m).__name__}")
        msg = dict(m)
        role = msg["role"] = "system" if m.get("role") == "developer" else m.get("role", "user")
        msg["content"] = _content_text(m.get("content"), f"{param}[{i}].content")
        if m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
        if role == "system" and leading_system and out:
            out[0]["content"] = "\n\n".join(c for c in (out[0]["content"], msg["content"]) if c)
            continue
        leading_system = leading_system and role == "system"
        out.append(msg)
    return out


def _content_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return json.dumps(content)
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in TEXT_PARTS:
            texts.append(str(part.get("text") or ""))
        elif isinstance(part, dict) and part.get("type") == "refusal":
            texts.append(str(part.get("refusal") or ""))
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{param}[{j}].type", f"content part type {kind!r} is not supported; only text is")
    return "".join(texts)


def _tool_call(call: Any) -> dict[str, Any]:
    """A call in the Chat shape, or the flat one of a Responses `function_call`, as templates take it."""
    call = call if isinstance(call, dict) else {}
    if call.get("type") == "custom":  # a custom tool's call: its name and free-text input
        return call
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:  # a malformed earlier call: kept as the model wrote it
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    call_id = call.get("id") or call.get("call_id")
    out: dict[str, Any] = {"type": "function", "function": {"name": str(fn.get("name", "")), "arguments": args}}
    return {"id": call_id, **out} if call_id else out


def hermes_messages(messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """Rewrites a normalised conversation for a template that only renders `role` and `content`.

    Tool signatures join the system message (one is added when there is none), an assistant's
    `tool_calls` become `<tool_call>` blocks after its text, and tool results stay `tool` turns
    wrapped in `<tool_response>`. Every message is kept, so nothing of the conversation is dropped.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role, text = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                if call.get("type") == "custom":
                    blocks.append(custom.render_call(call["custom"]["name"], call["custom"]["input"]))
                    continue
                args = call["function"]["arguments"]
                args = args if isinstance(args, str) else json.dumps(args)
                blocks.append(HERMES.render_call(call["function"]["name"], args))
            text = "\n".join(([text] if text else []) + blocks)
        elif role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if tools:
        system = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(_signature(t)) for t in tools))
        if any(t.kind == "custom" for t in tools):
            system += "\n\n" + custom.INSTRUCTIONS
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _signature(tool: ToolSpec) -> dict[str, Any]:
    """How a tool is listed to the model: a function's Chat shape, a custom tool's own."""
    if tool.kind != "custom":
        return tool.openai()
    sig: dict[str, Any] = {"type": "custom", "name": tool.name, "description": tool.description}
    if tool.format and tool.format.get("type") == "grammar":
        sig["format"] = tool.format
    return sig


def inline_custom(messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """For a template that renders tools itself: custom calls leave `tool_calls` (no template
    knows them) and join the assistant's text in their frame, as the model wrote them; the custom
    frame's instructions join the system message."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if any(c.get("type") == "custom" for c in calls):
            frames = [
                custom.render_call(c["custom"]["name"], c["custom"]["input"])
                for c in calls
                if c.get("type") == "custom"
            ]
            m = {**m, "content": "".join([m["content"], *frames])}
            rest = [c for c in calls if c.get("type") != "custom"]
            if rest:
                m["tool_calls"] = rest
            else:
                m.pop("tool_calls")
        out.append(m)
    if any(t.kind == "custom" for t in tools):
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{custom.INSTRUCTIONS}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": custom.INSTRUCTIONS})
    return out


def render_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[int]:
    """Prompt token ids for a conversation (Chat messages, tool calls in either API's shape) with tools;
    a tokenizer without a chat template (a base model) renders it with the built-in ChatML.

    Raises:
        InvalidRequest: see `normalize_messages`.
        NoChatTemplate: the model is served with `--chat-template none`.
    """
    messages = normalize_messages(messages)
    if tokenizer.renders_tools:
        return tokenizer.apply_chat_template(
            inline_custom(messages, tools), tools=[t.openai() for t in tools] or None, fallback=True
        )
    return tokenizer.apply_chat_template(hermes_messages(messages, tools), fallback=True)
