"""Tool-call formats: how a model family writes a call, and which grammar constrains it.

The format is chosen from the chat template (`detect_format`), or by the operator
(`--tool-call-format`, through `resolve_format`). Grammars come from xgrammar's built-in structural
tags where it knows the family (Hermes `<tool_call>` = its `qwen_3` tag, Llama 3 JSON = `llama`);
Mistral's `[TOOL_CALLS][...]` is a structural tag of our own. `tool_choice="none"` and `"required"`
are built here for every format, because the built-in tags leave the call marker allowed under
`none` and free text allowed before a `required` call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from xgrammar import structural_tag as st

from engine.loading.tokenizer import Tokenizer
from tools import custom
from tools.constraints import parse_tool_choice
from tools.schema import ToolSpec


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One way of writing calls; the fields drive both the grammar and `tools.calls.ToolCallParser`.

    Attributes:
        name: what `--tool-call-format` accepts.
        start: the text that opens a call (or, for `array`, the list of calls).
        end: the text that closes a call ("" when the JSON object's end closes it).
        args_key: the key holding the arguments in the call's JSON object.
        start_in_body: `start` is the beginning of the call's JSON (Llama 3's `{"name": `).
        array: calls are a JSON array after `start` (Mistral), not one object per marker.
        xgr_model: xgrammar's built-in structural tag, or None when ours is used.
    """

    name: str
    start: str
    end: str
    args_key: str
    start_in_body: bool = False
    array: bool = False
    xgr_model: str | None = None

    def call_begin(self, tool: str) -> str:
        """The fixed text of a call to `tool` up to its arguments (what the grammar forces)."""
        head = f'{{"name": {json.dumps(tool)}, "{self.args_key}": '
        return head if self.start_in_body or self.array else f"{self.start}\n{head}"

    def call_end(self) -> str:
        return "}" if self.start_in_body or self.array else f"}}\n{self.end}"

    def render_call(self, tool: str, arguments: str) -> str:
        """A finished call as the model writes it (for earlier assistant turns in a prompt)."""
        body = f"{self.call_begin(tool)}{arguments}{self.call_end()}"
        return f"{self.start}[{body}]" if self.array else body


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", xgr_model="qwen_3")
LLAMA3 = ToolCallFormat("llama3", '{"name": ', "", "parameters", start_in_body=True, xgr_model="llama")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "", "arguments", array=True)
# Whitespace allowed between JSON tokens of arguments: a small model left free pads without end.
MAX_WHITESPACE = 1
FORMATS: dict[str, ToolCallFormat] = {"hermes": HERMES, "qwen": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}


def resolve_format(name: str) -> ToolCallFormat:
    """The format for a `--tool-call-format` value (hermes, qwen, llama3, mistral)."""
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; choose from {', '.join(FORMATS)}") from None


def detect_format(tokenizer: Tokenizer) -> ToolCallFormat:
    """The format the model's chat template teaches; Hermes when the template never renders tools,
    because then `tools.prompt.render_prompt` writes the Hermes instructions into the prompt itself."""
    template = tokenizer.chat_template
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return HERMES


def needs_special_tokens(fmt: ToolCallFormat, tokenizer: Tokenizer) -> bool:
    """Whether a marker of `fmt` holds a special token of `tokenizer` (Mistral's `[TOOL_CALLS]`).

    Decoding with `skip_special_tokens` would strip it before `ToolCallParser` sees the text, so the
    call would come out as plain JSON text: such a request's detokenizer must keep special tokens
    (`SamplingParams(skip_special_tokens=False)`).
    """
    for marker in (fmt.start, fmt.end):
        ids = list(tokenizer.hf.encode(marker, add_special_tokens=False)) if marker else []
        if ids and tokenizer.decode(ids) != tokenizer.decode(ids, skip_special_tokens=False):
            return True
    return False


def structural_tag(
    fmt: ToolCallFormat,
    tools: list[ToolSpec],
    tool_choice: Any = "auto",
    parallel_tool_calls: bool = True,
    text: st.Format | None = None,
) -> st.StructuralTag:
    """The structural tag constraining a reply under `tool_choice` (either API's shape, or a `ToolChoice`).

    none: any text that never contains the call marker. auto: free text until the marker, then a
    declared function's call. required: only calls, at least one. named: exactly one call of that
    function. `parallel_tool_calls=False`: the reply ends after the first call. `text`, when given,
    is what the reply must be if it calls nothing (a JSON format): under auto the reply is then
    either that text or calls alone, under none that text.

    Raises:
        InvalidToolChoice: see `tools.constraints.parse_tool_choice`.
    """
    choice = parse_tool_choice(tool_choice, tools)
    allowed = choice.allowed(tools)
    frames = [t for t in allowed if t.kind == "custom"]
    starts = [fmt.start, custom.OPEN] if any(t.kind == "custom" for t in tools) else [fmt.start]
    if not allowed:
        return st.StructuralTag(format=text or st.AnyTextFormat(excludes=starts))
    single = choice.single or not parallel_tool_calls
    if frames:  # custom tools' frames beside the format's calls (`tools.custom`)
        return _with_custom(fmt, allowed, choice.mode, single, text)
    tags = [_call_tag(fmt, t) for t in allowed]
    calls: st.Format
    if fmt.array:
        listed = st.TagsWithSeparatorFormat(tags=tags, separator=", ", at_least_one=True, stop_after_first=single)
        calls = st.TagFormat(begin=f"{fmt.start}[", content=listed, end="]")
    else:
        sep = "\n" if fmt.end else ", "
        calls = st.TagsWithSeparatorFormat(tags=tags, separator=sep, at_least_one=True, stop_after_first=single)
    if choice.mode == "required":
        return st.StructuralTag(format=calls)
    if text is not None:
        return st.StructuralTag(format=st.OrFormat(elements=[text, calls]))
    if fmt.array:
        assert isinstance(calls, st.TagFormat)
        return st.StructuralTag(
            format=st.TriggeredTagsFormat(triggers=[fmt.start], tags=[calls], stop_after_first=True)
        )
    if fmt.xgr_model is not None:
        return xgr.get_builtin_structural_tag(
            fmt.xgr_model,
            tools=[t.openai() for t in allowed],
            tool_choice="auto",
            reasoning=False,
            parallel_tool_calls=parallel_tool_calls,
            max_whitespace_cnt=MAX_WHITESPACE,
        )
    return st.StructuralTag(format=st.TriggeredTagsFormat(triggers=[fmt.start], tags=tags, stop_after_first=single))


def _with_custom(
    fmt: ToolCallFormat, allowed: list[ToolSpec], mode: str, single: bool, text: st.Format | None
) -> st.StructuralTag:
    """A reply whose tools include custom ones: each call is a function call in `fmt`'s syntax (one
    object per call; Mistral's array holds one call) or a custom tool's frame."""
    tags = [
        custom.call_tag(t.name, t.format)
        if t.kind == "custom"
        else _call_tag(fmt, t)
        if not fmt.array
        else st.TagFormat(begin=f"{fmt.start}[", content=_call_tag(fmt, t), end="]")
        for t in allowed
    ]
    sep = "\n" if fmt.end or fmt.array else ", "
    calls = st.TagsWithSeparatorFormat(tags=tags, separator=sep, at_least_one=True, stop_after_first=single)
    if mode == "required":
        return st.StructuralTag(format=calls)
    if text is not None:
        return st.StructuralTag(format=st.OrFormat(elements=[text, calls]))
    triggers = [custom.OPEN] + ([fmt.start] if len(tags) > sum(t.kind == "custom" for t in allowed) else [])
    return st.StructuralTag(format=st.TriggeredTagsFormat(triggers=triggers, tags=tags, stop_after_first=single))


def _call_tag(fmt: ToolCallFormat, tool: ToolSpec) -> st.TagFormat:
    """One call of `tool`: fixed text around arguments constrained by its parameters' schema."""
    args = st.JSONSchemaFormat(json_schema=tool.parameters, max_whitespace_cnt=MAX_WHITESPACE)
    return st.TagFormat(begin=fmt.call_begin(tool.name), content=args, end=fmt.call_end())
