"""A turn's context to prompt token ids, reusing the previous turn's ids.

Items become Chat messages (`to_messages`): a `function_call` (or `custom_tool_call`) joins the
assistant message before it as a `tool_calls` entry (under its namespace-qualified name), a
`function_call_output` (`custom_tool_call_output`) is a `tool` turn, a `reasoning` item is the
next assistant message's `reasoning_content` (Qwen3's templates read it), `instructions` are a
leading developer message. `tools.prompt` then normalises them and renders them with the chat
template (Hermes style for templates that ignore tools), here as text.

KV reuse: a stored response keeps its prompt ids P and output ids O. The next prompt is P + O +
the tokens of only what the template adds after them, so no re-tokenization of earlier text can
change an id and miss the cached pages. The text P + O stands for is their decoding; if the new
rendering starts with it, only the rest is tokenized (it begins with the end-of-turn marker that
ended generation, which is not in O). A template that is not append-only (one that drops earlier
reasoning, or changed instructions) does not start with it: the prompt is rendered whole and the
miss is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from engine.loading.tokenizer import Tokenizer
from sessions.errors import InvalidParam
from sessions.items import (
    CallOutput,
    Compaction,
    CustomToolCall,
    FunctionCall,
    InputImage,
    Item,
    Message,
    Reasoning,
    Refusal,
)
from tools.prompt import hermes_messages, inline_custom, normalize_messages
from tools.schema import ToolSpec

log = logging.getLogger("longctx.sessions")


class Prompt(NamedTuple):
    """A turn's prompt: its ids, and how many leading ids were the previous turn's (0: re-rendered);
    `images`: the engine's inputs of the images whose placeholder runs the ids hold, in order."""

    ids: list[int]
    reused: int
    text: str
    images: tuple[Any, ...] = ()


def message_text(item: Message, image_marker: str | None = None) -> str:
    """A message's parts joined; an image part is `image_marker` (`[image]` when None)."""
    texts = []
    for p in item.content:
        if isinstance(p, InputImage):
            texts.append(image_marker if image_marker is not None else "[image]")
        else:
            texts.append(p.refusal if isinstance(p, Refusal) else p.text)
    return "".join(texts)


def to_messages(
    items: Sequence[Item], instructions: str | None = None, image_marker: str | None = None
) -> list[dict[str, Any]]:
    """Chat messages for a context (see the module docstring). Compaction items are skipped;
    image parts are written as `image_marker` in their message's text (`sessions.image_prompt`)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "developer", "content": instructions})
    reasoning: list[str] = []
    for item in items:
        last = out[-1] if out else None
        if isinstance(item, Message):
            msg: dict[str, Any] = {"role": item.role, "content": message_text(item, image_marker)}
            if item.role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "\n".join(reasoning), []
            out.append(msg)
        elif isinstance(item, FunctionCall | CustomToolCall):
            call: dict[str, Any]
            if isinstance(item, FunctionCall):  # a namespace's tool by the name the model called it by
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.qualified_name, "arguments": item.arguments},
                }
            else:
                call = {
                    "id": item.call_id,
                    "type": "custom",
                    "custom": {"name": item.qualified_name, "input": item.input},
                }
            if last is not None and last["role"] == "assistant":  # the reply's text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = "\n".join(reasoning), []
                out.append(msg)
        elif isinstance(item, CallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif isinstance(item, Reasoning):
            reasoning.append("".join(p.text for p in item.content) or "".join(p.text for p in item.summary))
        else:
            assert isinstance(item, Compaction)
    return out


def render_text(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[ToolSpec],
    *,
    generation_prompt: bool = True,
    thinking: bool = True,
) -> str:
    """The chat template's text for `messages` (normalised by `tools.prompt` first).

    Args:
        thinking: the template's `enable_thinking` switch (Qwen3); templates without it ignore it.
    """
    tokenizer.check_chat()
    msgs = normalize_messages(messages)
    if not msgs:
        raise InvalidParam("input", "the context holds no message to answer (reasoning items alone render nothing)")
    kwargs: dict[str, Any] = {"add_generation_prompt": generation_prompt, "tokenize": False}
    if not thinking:
        kwargs["enable_thinking"] = False
    if tokenizer.renders_tools:
        text = tokenizer.hf.apply_chat_template(
            inline_custom(msgs, tools), tools=[t.openai() for t in tools] or None, **kwargs
        )
    else:
        text = tokenizer.hf.apply_chat_template(hermes_messages(msgs, tools), **kwargs)
    return str(text)


def render_messages(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> Prompt:
    """A stateless turn's prompt (Chat Completions' `messages`), rendered and tokenized whole."""
    text = render_text(tokenizer, messages, tools)
    return Prompt(encode(tokenizer, text), 0, text)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Rendered text to ids: special tokens in the text are read as such, none are added (the
    template writes its own BOS), as `apply_chat_template(tokenize=True)` does."""
    return [int(t) for t in tokenizer.hf.encode(text, add_special_tokens=False)]


def decode_exact(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text ids stand for, special tokens included, spaces untouched."""
    return str(tokenizer.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


def build_prompt(tokenizer: Tokenizer, text: str, previous: Sequence[int] | None) -> Prompt:
    """Prompt ids for rendered `text`, continuing `previous` (the last turn's prompt + output ids)
    when `text` starts with what they stand for (see the module docstring)."""
    if previous:
        head = decode_exact(tokenizer, previous)
        if text.startswith(head) and len(text) > len(head):
            return Prompt([*previous, *encode(tokenizer, text[len(head) :])], len(previous), text)
        log.info(
            "prompt re-rendered whole: the template's new rendering does not continue the previous turn's "
            "%d tokens (a template that is not append-only, or changed instructions or tools)",
            len(previous),
        )
    return Prompt(encode(tokenizer, text), 0, text)
