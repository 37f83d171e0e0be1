"""Replies to output items and events, from scripted text in chunks of every size: reasoning becomes
a `reasoning` item (never message text), calls become `function_call` items with argument deltas
adding up, a calls-only reply has no message item, every item is added then done in order with
contiguous sequence numbers; `reasoning.effort: none` turns a Qwen3-style template's thinking off."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

from engine.loading.tokenizer import Tokenizer
from sessions.events import Event, EventWriter
from sessions.items import FunctionCall, Item, Message, Reasoning, text_of
from sessions.output import OutputAssembler
from sessions.reasoning import ReasoningSplitter
from sessions.render import render_text
from tests.structured_demo import compiler
from tools.calls import ToolCallParser
from tools.formats import HERMES
from tools.schema import parse_tools

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def assemble(text: str, size: int, tools: bool = True, reasoning: bool = True) -> tuple[list[Item], list[Event]]:
    events: list[Event] = []

    async def sink(e: Event) -> None:
        events.append(e)

    async def main() -> list[Item]:
        parser = ToolCallParser(HERMES, TOOLS) if tools else None
        asm = OutputAssembler(EventWriter(sink), parser, ReasoningSplitter(reasoning))
        for i in range(0, len(text), size):
            await asm.feed(text[i : i + size])
        return await asm.finish("completed")

    return asyncio.run(main()), events


def check_events(items: list[Item], events: list[Event]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for index, item in enumerate(items):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert mine[-1]["item"] == item
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        done = [e for e in mine if e["type"].endswith("_text.done") or e["type"].endswith("arguments.done")]
        assert len(done) == 1 and deltas == done[0].get("text", done[0].get("arguments"))


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_reasoning_text_and_a_call(size: int) -> None:
    items, events = assemble(f"<think>\nWeather needs a tool.\n</think>\n\nLet me check.\n{CALL}", size)
    assert [type(i) for i in items] == [Reasoning, Message, FunctionCall]
    assert isinstance(items[0], Reasoning) and items[0].content[0].text == "\nWeather needs a tool.\n"
    assert text_of(items[1]) == "\n\nLet me check.\n" or text_of(items[1]).strip() == "Let me check."
    assert isinstance(items[2], FunctionCall) and items[2].arguments == '{"city": "Paris"}'
    check_events(items, events)


@pytest.mark.parametrize("size", [1, 1000])
def test_calls_only_reply_has_no_message(size: int) -> None:
    items, events = assemble(f"\n{CALL}\n{CALL}\n", size)
    assert [type(i) for i in items] == [FunctionCall, FunctionCall]
    assert items[0].call_id != items[1].call_id  # type: ignore[union-attr]
    check_events(items, events)


def test_plain_text_without_tools_or_reasoning() -> None:
    items, events = assemble("<think>kept</think> as text", 2, tools=False, reasoning=False)
    assert [text_of(i) for i in items] == ["<think>kept</think> as text"]
    check_events(items, events)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 14,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip


QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_effort_none_switches_thinking_off(demo_gguf: Path) -> None:
    demo = compiler(str(demo_gguf)).tokenizer
    hf = copy.deepcopy(demo.hf)
    hf.chat_template = QWEN3_STYLE
    tok = Tokenizer(hf, demo.eos_token_ids)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    assert render_text(tok, messages, []).endswith("<|im_start|>assistant\n")
    assert render_text(tok, messages, [], thinking=False).endswith("<think>\n\n</think>\n\n")
