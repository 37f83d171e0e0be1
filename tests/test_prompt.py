"""Conversations to prompts: Hermes rendering for the demo model's plain ChatML, and for both it and
a Qwen2.5-style tool template, messages normalised first (arguments as dicts, content as strings,
developer as system)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from engine.loading.tokenizer import Tokenizer
from tests.structured_demo import compiler, qwen_style
from tools.prompt import normalize_messages, render_prompt
from tools.schema import InvalidRequest, parse_tools

TOOLS = parse_tools(
    [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
)  # fmt: skip
CALL_TURN: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]  # fmt: skip


@pytest.fixture(scope="module")
def demo(demo_gguf: Path) -> Tokenizer:
    return compiler(str(demo_gguf)).tokenizer


@pytest.fixture(scope="module")
def qwen(demo: Tokenizer) -> Tokenizer:
    return qwen_style(demo)


def _text(tok: Tokenizer, messages: list[dict[str, Any]], tools: Any = TOOLS) -> str:
    return tok.decode(render_prompt(tok, messages, tools), skip_special_tokens=False)


def test_hermes_rendering_keeps_the_whole_conversation(demo: Tokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        *CALL_TURN,
        {"role": "assistant", "content": "It is 18C and sunny."},
        {"role": "user", "content": "Thanks!"},
    ]
    text = _text(demo, messages)
    for needle in [
        "<|im_start|>system\nBe brief.\n\n# Tools",
        json.dumps(TOOLS[0].openai()),
        'assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>tool\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>",
        "It is 18C and sunny.",
        "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n",
    ]:
        assert needle in text


def test_arguments_are_rendered_once_by_tool_templates(qwen: Tokenizer) -> None:
    flat = {"call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'}  # a Responses call
    messages: list[dict[str, Any]] = [*CALL_TURN, {"role": "assistant", "content": "", "tool_calls": [flat]}]
    text = _text(qwen, messages)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in text
    assert '\\"city' not in text, "arguments quoted twice"
    (call,) = normalize_messages([{"role": "assistant", "tool_calls": [flat]}])[0]["tool_calls"]
    assert call == {
        "id": "call_2",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
    }
    broken = normalize_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
    assert broken[0]["tool_calls"][0]["function"]["arguments"] == "{", "not JSON: kept as the model wrote it"


@pytest.mark.parametrize("which", ["demo", "qwen"])
def test_content_parts_and_none_become_strings(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
        {"role": "user", "content": None},
    ]
    text = _text(tok, messages, [])
    assert "<|im_start|>user\nHi there<|im_end|>" in text and "<|im_start|>assistant\nHello!<|im_end|>" in text
    assert "<|im_start|>user\n<|im_end|>" in text


def test_non_text_content_is_refused_by_path() -> None:
    image = {"type": "input_image", "image_url": "https://example.invalid/cat.png"}
    with pytest.raises(InvalidRequest) as e:
        normalize_messages([{"role": "user", "content": "hi"}, {"role": "user", "content": [image]}])
    assert e.value.param == "messages[1].content[0].type" and "'input_image' is not supported" in str(e.value)


@pytest.mark.parametrize("which", ["demo", "qwen"])
def test_developer_is_system(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    for tools in ([], TOOLS):
        text = _text(
            tok, [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}], tools
        )
        assert text.startswith("<|im_start|>system\nAnswer in French.")
        assert "SmolLM" not in text and "You are Qwen" not in text and "developer" not in text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Now in German."},
    ]
    text = _text(tok, messages, [])
    assert text.startswith("<|im_start|>system\nBe brief.\n\nAnswer in French.<|im_end|>\n<|im_start|>user\nhi")
    assert "<|im_start|>system\nNow in German.<|im_end|>" in text


def test_normalising_leaves_the_request_alone() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": [{"type": "input_text", "text": "x"}]},
        *CALL_TURN,
    ]
    before = copy.deepcopy(messages)
    normalize_messages(messages)
    assert messages == before
