"""Turn contexts to prompts: items as chat messages, each turn's prompt ids a token prefix of the
next turn's (the demo model's ChatML with Hermes tools, and a Qwen2.5-style tool template), with a
tool call and its output among the turns; a template that is not append-only is rendered whole
(and says so); backfill; reasoning text split out of replies however they are chunked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.loading.tokenizer import Tokenizer
from sessions.context import check_backfill, check_ids
from sessions.items import FunctionCall, FunctionCallOutput, Item, Message, OutputText, parse_input
from sessions.reasoning import ReasoningSplitter, opens_in_reasoning
from sessions.render import build_prompt, decode_exact, encode, render_text, to_messages
from sessions.requests import InvalidParam
from tests.structured_demo import compiler, qwen_style
from tools.schema import parse_tools

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])  # fmt: skip
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def demo(demo_gguf: Path) -> Tokenizer:
    return compiler(str(demo_gguf)).tokenizer


@pytest.fixture(scope="module")
def qwen(demo: Tokenizer) -> Tokenizer:
    return qwen_style(demo)


def _assistant(text: str) -> Message:
    return Message(id="msg_a", role="assistant", content=[OutputText(text=text)])


# Each turn: (new input items, what the model writes, the output items it becomes)
TURNS: list[tuple[list[Item], str, list[Item]]] = [
    (parse_input("What is the weather in Paris?"), CALL_TEXT,
     [FunctionCall(id="fc_1", call_id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
    ([FunctionCallOutput(id="fco_1", call_id="call_1", output="18C, sunny")], "It is 18C and sunny in Paris.",
     [_assistant("It is 18C and sunny in Paris.")]),
    (parse_input("Thanks! And tomorrow?"), "I cannot know that yet.", [_assistant("I cannot know that yet.")]),
    (parse_input("Fine."), "Bye.", [_assistant("Bye.")]),
]  # fmt: skip


@pytest.mark.parametrize("template", ["demo", "qwen"])
def test_each_prompt_is_a_token_prefix_of_the_next(template: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(template)
    history: list[Item] = []
    previous: list[int] | None = None
    for i, (new, reply, output) in enumerate(TURNS):
        text = render_text(tok, to_messages([*history, *new], "Be brief."), TOOLS)
        prompt = build_prompt(tok, text, previous)
        if previous is not None:
            assert prompt.ids[: len(previous)] == previous, f"turn {i}"
            assert prompt.reused == len(previous)
        assert decode_exact(tok, prompt.ids) == text  # the ids stand for exactly this turn's rendering
        previous = [*prompt.ids, *encode(tok, reply)]  # the engine's output ids stop before <|im_end|>
        history += [*new, *output]
    assert "<tool_response>\n18C, sunny\n</tool_response>" in text
    assert text.count(CALL_TEXT) == 1


def test_changed_instructions_render_whole_and_log(demo: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    first = build_prompt(demo, render_text(demo, to_messages(TURNS[2][0], "Be brief."), []), None)
    previous = [*first.ids, *encode(demo, "I cannot know that yet.")]
    history = [*TURNS[2][0], *TURNS[2][2], *TURNS[3][0]]
    text = render_text(demo, to_messages(history, "Be verbose."), [])
    with caplog.at_level(logging.INFO, logger="longctx.sessions"):
        prompt = build_prompt(demo, text, previous)
    assert prompt.reused == 0 and prompt.ids == encode(demo, text)
    assert "re-rendered whole" in caplog.text


def test_messages_from_items() -> None:
    items = parse_input([
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a"},
        {"type": "function_call_output", "call_id": "c2", "output": "b"},
    ])  # fmt: skip
    messages = to_messages(items, "Be brief.")
    assert [m["role"] for m in messages] == ["developer", "developer", "user", "assistant", "tool", "tool"]
    assert messages[3]["content"] == "Let me check." and [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]
    assert messages[5] == {"role": "tool", "tool_call_id": "c2", "content": "b"}


def test_backfill_must_answer_an_open_call() -> None:
    history: list[Item] = [FunctionCall(id="fc_1", call_id="c1", name="f", arguments="{}")]
    check_backfill(history, [FunctionCallOutput(id="o1", call_id="c1", output="x")])
    answered: list[Item] = [*history, FunctionCallOutput(id="o1", call_id="c1", output="x")]
    cases: list[tuple[list[Item], list[Item], str]] = [
        (history, [FunctionCallOutput(id="o2", call_id="zz", output="x")], "no function_call"),
        (answered, [FunctionCallOutput(id="o2", call_id="c1", output="x")], "already been answered"),
        ([], [*parse_input("hi"), FunctionCallOutput(id="o2", call_id="c1", output="x")], "no function_call"),
    ]
    for hist, new, why in cases:
        with pytest.raises(InvalidParam, match=why) as e:
            check_backfill(hist, new)
        assert e.value.param == f"input[{len(new) - 1}].call_id"


REPLY = "  <think>\nThe user greets.\n</think>\n\nHello there! <thi"


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(REPLY)])
def test_reasoning_split_is_independent_of_chunking(size: int) -> None:
    splitter = ReasoningSplitter()
    pieces = [p for i in range(0, len(REPLY), size) for p in splitter.feed(REPLY[i : i + size])]
    pieces += splitter.finish()
    reasoning = "".join(p.text for p in pieces if p.reasoning)
    answer = "".join(p.text for p in pieces if not p.reasoning)
    assert reasoning == "\nThe user greets.\n" and answer == "\n\nHello there! <thi"


def test_reasoning_from_an_open_think_and_plain_replies() -> None:
    assert opens_in_reasoning("<|im_start|>assistant\n<think>\n") and not opens_in_reasoning("<think></think>x")
    s = ReasoningSplitter(in_reasoning=True)
    pieces = s.feed("plan</think>answer") + s.finish()
    assert [(p.reasoning, p.text) for p in pieces] == [(True, "plan"), (False, "answer")]
    plain = ReasoningSplitter()
    assert [p.text for p in plain.feed("<b>hi") + plain.finish()] == ["<b>hi"]
    off = ReasoningSplitter(enabled=False)
    assert [p.reasoning for p in off.feed("<think>x</think>")] == [False]


def test_input_ids_must_be_new() -> None:
    history = parse_input([{"id": "msg_1", "role": "user", "content": "hi"}])
    check_ids(history, parse_input("again"))
    twice = [{"id": "m", "role": "user", "content": "x"}, {"id": "m", "role": "user", "content": "y"}]
    for hist, new in [(history, [{"id": "msg_1", "role": "user", "content": "x"}]), ([], twice)]:
        with pytest.raises(InvalidParam) as e:
            check_ids(hist, parse_input(new))
        assert e.value.param == f"input[{len(new) - 1}].id"


def test_shortened_outputs_are_found_in_the_previous_prompt(demo: Tokenizer) -> None:
    """A tool output shortened in one turn's prompt is recognised in that prompt's text, so the
    next turn shortens the same one (and not one the previous prompt had whole)."""
    from sessions.compaction import shorten, shortened_in

    long = "".join(f"line {i}: all quiet.\n" for i in range(60))
    items: list[Item] = [
        Message(id="msg_1", role="user", content=[OutputText(text="Read both logs.")]),
        FunctionCall(id="fc_1", call_id="c1", name="get_weather", arguments="{}"),
        FunctionCallOutput(id="fco_1", call_id="c1", output=long.replace("line", "one")),
        FunctionCall(id="fc_2", call_id="c2", name="get_weather", arguments="{}"),
        FunctionCallOutput(id="fco_2", call_id="c2", output=long.replace("line", "two")),
    ]
    previous = render_text(demo, to_messages(shorten(items, 3)), TOOLS)  # only the first one shortened
    assert shortened_in(previous, items) == {"fco_1"}
    again = shorten(items, len(items), only={"fco_1"})
    assert render_text(demo, to_messages(again), TOOLS) == previous
    assert shortened_in(render_text(demo, to_messages(items), TOOLS), items) == set()
