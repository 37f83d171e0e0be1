"""Tool calls: the streaming parser (whatever the chunking), format detection, and the demo model
calling declared tools under a grammar."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request import FinishReason
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from tests.structured_demo import compiler, demo_served, engine, with_special_marker
from tools import custom
from tools.calls import ArgumentsDelta, CallDone, CallStarted, Event, TextDelta, ToolCallParser
from tools.formats import (
    FORMATS,
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolCallFormat,
    detect_format,
    needs_special_tokens,
    resolve_format,
)
from tools.prompt import render_prompt
from tools.schema import parse_tools

TOOLS = parse_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                        "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "add", "description": "Add two integers",
         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"], "additionalProperties": False}}},
    ]
)  # fmt: skip
ALL_FORMATS = [HERMES, LLAMA3, MISTRAL]


def parse(fmt: ToolCallFormat, chunks: list[str]) -> list[Event]:
    ids = itertools.count()
    p = ToolCallParser(fmt, TOOLS, new_id=lambda: f"call_{next(ids)}")
    events: list[Event] = []
    for c in chunks:
        events += p.feed(c)
    return events + p.finish()


def summary(events: list[Event]) -> tuple[str, list[tuple[str, str, str, str | None]]]:
    """(all text, [(id, name, arguments, error)]), checking the event protocol on the way."""
    text, calls, open_args = [], [], {}
    for e in events:
        if isinstance(e, TextDelta):
            text.append(e.text)
        elif isinstance(e, CallStarted):
            assert e.call_index not in open_args
            open_args[e.call_index] = ""
        elif isinstance(e, ArgumentsDelta):
            open_args[e.call_index] += e.delta
        elif isinstance(e, CallDone):
            assert open_args.pop(e.call_index) == e.arguments, "argument deltas must add up to the arguments"
            calls.append((e.id, e.name, e.arguments, e.error))
    assert not open_args
    return "".join(text), calls


def render(fmt: ToolCallFormat, parts: list[str | tuple[str, str]]) -> str:
    """Text parts and (name, arguments) calls as the model would write them (Mistral: one array)."""
    if not fmt.array:
        return "".join(p if isinstance(p, str) else fmt.render_call(*p) + "\n" for p in parts)
    text = "".join(p for p in parts if isinstance(p, str))
    calls = [fmt.call_begin(p[0]) + p[1] + fmt.call_end() for p in parts if not isinstance(p, str)]
    return text + (f"{fmt.start}[{', '.join(calls)}]" if calls else "")


_text = st.text(alphabet=st.sampled_from(list('ab <>{}[]"\\\n:,_TOOL')), max_size=12)
_args = st.dictionaries(st.sampled_from(["city", "a", "b", "x y"]), st.one_of(st.integers(), st.text(max_size=6)))
_call = st.tuples(st.sampled_from(["get_weather", "add", "nope"]), _args.map(json.dumps))


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.one_of(_text, _call), max_size=5), cuts=st.lists(st.integers(0, 400), max_size=8))
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_same_calls_whatever_the_chunking(fmt: ToolCallFormat, parts: list[Any], cuts: list[int]) -> None:
    reply = render(fmt, parts)
    whole = summary(parse(fmt, [reply]))
    chunks = [reply[a:b] for a, b in itertools.pairwise([0, *sorted(c % (len(reply) + 1) for c in cuts), len(reply)])]
    assert summary(parse(fmt, chunks)) == whole
    assert summary(parse(fmt, list(reply))) == whole
    calls = [p for p in parts if not isinstance(p, str)]
    if all(fmt.start not in p and '{"name"' not in p for p in parts if isinstance(p, str)):
        assert [(name, args) for _, name, args, _ in whole[1]] == calls
        for (name, _), (_, _, _, error) in zip(calls, whole[1], strict=True):
            if name == "nope":
                assert error == "tool 'nope' is not declared"


def test_several_calls_one_chunk_and_token_by_token(demo_gguf: Path) -> None:
    tok = compiler(str(demo_gguf)).tokenizer.hf
    reply = "Let me check.\n" + HERMES.render_call("get_weather", '{"city": "Paris"}') + "\n"
    reply += HERMES.render_call("add", '{"a": 1, "b": "x"}')
    offsets = tok(reply, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    tokens = [reply[a:b] for a, b in offsets]
    assert "".join(tokens) == reply and len(tokens) > 20
    text, calls = summary(parse(HERMES, tokens))
    assert (text, calls) == summary(parse(HERMES, [reply]))
    assert text == "Let me check.", "whitespace next to calls is no text"
    assert [c[:3] for c in calls] == [
        ("call_0", "get_weather", '{"city": "Paris"}'),
        ("call_1", "add", '{"a": 1, "b": "x"}'),
    ]
    assert calls[0][3] is None
    assert calls[1][3] == "tool 'add': arguments invalid at $.b: 'x' is not of type 'integer'"


def test_unfinished_and_malformed_calls() -> None:
    _, calls = summary(parse(HERMES, ['<tool_call>\n{"name": "add", "arguments": {"a": 1']))
    assert calls == [("call_0", "add", '{"a": 1', "the reply ended inside the call")]
    text, calls = summary(parse(HERMES, ["<tool_call> not json", " then text"]))
    assert (text, calls) == ("<tool_call> not json then text", [])
    text, calls = summary(parse(HERMES, ["a <tool_c"]))
    assert (text, calls) == ("a <tool_c", [])


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_calls_alone_give_no_text_event(fmt: ToolCallFormat) -> None:
    calls = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]
    body = render(fmt, list(calls))
    for reply in [body, f"\n\n{body}\n", f" \n{body} \n\n"]:
        for chunks in ([reply], list(reply)):
            events = parse(fmt, chunks)
            assert not [e for e in events if isinstance(e, TextDelta)], (reply, events)
            assert [(name, args) for _, name, args, _ in summary(events)[1]] == calls


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_whitespace_before_text_is_kept(fmt: ToolCallFormat) -> None:
    reply = "Let me check.\n\n" + fmt.render_call("add", '{"a": 1, "b": 2}') + "\nDone. \n"
    for chunks in ([reply], list(reply)):
        text, calls = summary(parse(fmt, chunks))
        assert len(calls) == 1
        assert text == "Let me check.\nDone. \n"
    assert summary(parse(fmt, [" Hi,\n\nthere \n"])) == (" Hi,\n\nthere \n", []), "no call: text unchanged"


_lookalike = st.lists(
    st.sampled_from(
        [*'ab {}[]",:\n\\', "<tool_call>", "</tool_call>", '{"name": ', "[TOOL_CALLS]", '"name"', '"add"', '"x\ny"']
    ),
    max_size=14,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_lookalike, cut=st.integers(0, 200))
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_text_that_only_looks_like_a_call_comes_back_unchanged(fmt: ToolCallFormat, text: str, cut: int) -> None:
    cut %= len(text) + 1
    results = [summary(parse(fmt, chunks)) for chunks in ([text], list(text), [text[:cut], text[cut:]])]
    assert results[1:] == results[:1] * 2
    if not results[0][1]:
        assert results[0][0] == text


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HERMES, '<tool_call>\n{"city": "Paris"}\n</tool_call>'),  # no name
        (HERMES, "<tool_call>\n\n[1, 2]"),
        (HERMES, '<tool_call>\n{"name": 5}'),
        (LLAMA3, '{"name": }"arguments"'),  # junk before a string value
        (LLAMA3, '{"name": "a\nb"}'),  # a raw newline is no JSON string
        (MISTRAL, "[TOOL_CALLS][]"),
        (MISTRAL, "[TOOL_CALLS] [ x"),
    ],
)
def test_lookalikes_are_text_byte_for_byte(fmt: ToolCallFormat, text: str) -> None:
    for chunks in ([text], list(text)):
        assert summary(parse(fmt, chunks)) == (text, [])


def test_a_real_call_inside_a_lookalike_is_found() -> None:
    call = HERMES.render_call("add", '{"a": 1, "b": 2}')
    text, calls = summary(parse(HERMES, list("<tool_call> oops " + call)))
    assert text == "<tool_call> oops" and [c[1:3] for c in calls] == [("add", '{"a": 1, "b": 2}')]
    after = MISTRAL.render_call("add", '{"a": 1, "b": 2}')[:-1] + ", nope]"
    text, calls = summary(parse(MISTRAL, [after]))
    assert text == ", nope]" and len(calls) == 1


def test_format_detection_and_override(demo_gguf: Path) -> None:
    tok = compiler(str(demo_gguf)).tokenizer
    assert not tok.renders_tools and detect_format(tok) is HERMES  # plain ChatML: we render Hermes
    assert resolve_format("mistral") is MISTRAL and resolve_format("LLAMA3") is LLAMA3 and set(FORMATS) >= {"hermes"}
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        resolve_format("xml")


def test_special_token_marker_reaches_the_parser(demo_gguf: Path) -> None:
    tok = with_special_marker(demo_gguf)
    assert needs_special_tokens(MISTRAL, tok) and not needs_special_tokens(HERMES, tok)
    assert not needs_special_tokens(MISTRAL, compiler(str(demo_gguf)).tokenizer), "there it is plain text"
    reply = MISTRAL.render_call("add", '{"a": 1, "b": 2}')
    ids = tok.hf.encode(reply, add_special_tokens=False)
    assert ids[0] == tok.hf.convert_tokens_to_ids("[TOOL_CALLS]")

    def parsed(skip_special_tokens: bool) -> tuple[str, list[Any]]:
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens)
        return summary(parse(MISTRAL, [detok.add(i) for i in ids] + [detok.flush()]))

    assert parsed(not needs_special_tokens(MISTRAL, tok)) == ("", [("call_0", "add", '{"a": 1, "b": 2}', None)])
    assert parsed(True)[1] == [], "skipping special tokens loses the marker, and with it the call"


def test_demo_model_calls_declared_tools(demo_gguf: Path) -> None:
    """required -> a valid call to a declared tool; a named function -> that function; one batch."""
    lm, gc = demo_served(str(demo_gguf)), compiler(str(demo_gguf))
    eng = engine(lm)
    asks = {
        "required": ("required", "What is the weather like in Paris today?"),
        "named": ({"type": "function", "function": {"name": "add"}}, "What is 2 plus 3?"),
        "named_other": ({"type": "function", "function": {"name": "get_weather"}}, "What is 2 plus 3?"),
        "none": ("none", "What is the weather like in Paris today?"),
    }
    handles = {}
    for key, (choice, question) in asks.items():
        prompt = render_prompt(lm.tokenizer, [{"role": "user", "content": question}], TOOLS)
        matcher = gc.matcher(gc.tool_calls(HERMES, TOOLS, choice, parallel_tool_calls=False))
        params = SamplingParams(max_tokens=64 if key == "none" else 128, temperature=0)
        handles[key] = eng.add_request(prompt, params, matcher=matcher)
    eng.run_until_idle()
    results = {}
    for key, h in handles.items():
        _, text, reason = h.result()
        results[key] = (summary(parse(HERMES, [text])), reason)
    for key, name in [("required", None), ("named", "add"), ("named_other", "get_weather")]:
        (text, calls), reason = results[key]
        assert reason is FinishReason.STOP and text.strip() == "" and len(calls) == 1, results[key]
        _, called, args, error = calls[0]
        assert error is None and called in {t.name for t in TOOLS} and called == (name or called)
        assert isinstance(json.loads(args), dict)
    (text, calls), _ = results["none"]
    assert calls == [] and "<tool_call>" not in text


WITH_CUSTOM = [*TOOLS, *parse_tools([{"type": "custom", "name": "apply_patch"}, {"type": "custom", "name": "sql"}])]
_custom = st.tuples(st.sampled_from(["apply_patch", "sql", "nada"]),
                    st.text(alphabet=st.sampled_from(list('ab <>/{}"\n_tool')), max_size=14))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(st.one_of(_text, _call, _custom.map(list)), max_size=5),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
def test_custom_calls_whatever_the_chunking(fmt: ToolCallFormat, parts: list[Any], cuts: list[int]) -> None:
    """Custom tools' frames (`tools.custom`) among text and function calls: every chunking gives
    the events of the unchunked reply; a frame's input comes back exactly."""
    reply = "".join(p if isinstance(p, str) else custom.render_call(*p) if isinstance(p, list)
                    else fmt.render_call(*p) + "\n" for p in parts)  # fmt: skip

    def run(chunks: list[str]) -> tuple[str, list[tuple[str, str, str, str | None]]]:
        ids = itertools.count()
        p = ToolCallParser(fmt, WITH_CUSTOM, new_id=lambda: f"call_{next(ids)}")
        events: list[Event] = [e for c in chunks for e in p.feed(c)]
        return summary(events + p.finish())

    whole = run([reply])
    chunks = [reply[a:b] for a, b in itertools.pairwise([0, *sorted(c % (len(reply) + 1) for c in cuts), len(reply)])]
    assert run(chunks) == whole and run(list(reply)) == whole
    frames = [p for p in parts if isinstance(p, list)]
    plain = all(custom.CLOSE not in p[1] and "<" not in p[1] for p in frames)
    if plain and all("<" not in p and "{" not in p for p in parts if isinstance(p, str)):
        got = [(name, args) for _, name, args, _ in whole[1] if name in ("apply_patch", "sql", "nada")]
        assert [tuple(p) for p in frames] == got
        for (name, _), error in zip(frames, [e for _, n, _, e in whole[1] if n in ("apply_patch", "sql", "nada")],
                                    strict=True):  # fmt: skip
            assert (error == "custom tool 'nada' is not declared") == (name == "nada")
