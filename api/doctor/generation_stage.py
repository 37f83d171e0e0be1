"""Stage 5, generation: the serving path end to end, through `Engine` with the tokenizer.

A chat-templated greedy answer; stop conditions (a token budget ends with `length`, a stop
string cuts the same answer before it and is never emitted); a JSON-schema output parsed and
validated against its schema; a tool call with a declared tool, parsed. Schemas are bounded
(enums, `maxLength`) so that even a random model finishes them. TTFT and tokens/s come from
the engine.
"""

from __future__ import annotations

import json
import time
from typing import Any

from api.doctor.context import DoctorContext
from api.doctor.report import StageResult
from engine.engine import Engine, EngineConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

QUESTION = "What is the capital of France? Answer in one sentence."
ANSWER_TOKENS = 32
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain"]},
        "capital": {"type": "string", "maxLength": 12},
        "confident": {"type": "boolean"},
    },
    "required": ["country", "capital", "confident"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome", "Madrid"]},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]
STRUCTURED_TOKENS = 64


class _Run:
    """One request's outcome."""

    def __init__(self, engine: Engine, ids: list[int], params: SamplingParams, matcher: Any = None):
        t0 = time.perf_counter()
        handle = engine.add_request(ids, params, matcher=matcher)
        engine.run_until_idle()
        outs = list(handle)
        self.seconds = time.perf_counter() - t0
        self.ids = [t for o in outs for t in o.token_ids]
        self.text = "".join(o.text_delta for o in outs)
        self.finish = outs[-1].finish_reason
        self.error = outs[-1].error


def generation_stage(ctx: DoctorContext, st: StageResult) -> None:
    tok = ctx.loaded.tokenizer
    if not tok.chat_template:
        st.warn("the tokenizer has no chat template; prompts are raw text")
    model = ctx.loaded.model
    c = model.config
    per_token = 2 * c.num_layers * model.local_kv_heads * c.head_dim * ctx.dtype.itemsize
    engine = Engine(model, tok, EngineConfig(kv_cache_bytes=4096 * per_token, attention_backend="auto"))
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tok.apply_chat_template(messages) if tok.chat_template else tok.encode(QUESTION)
    rows: list[list[object]] = []

    answer = _Run(engine, prompt, SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0))
    rows.append(["greedy answer", answer.finish.value if answer.finish else "?", len(answer.ids), answer.text[:60]])
    if answer.error or answer.finish not in (FinishReason.STOP, FinishReason.LENGTH):
        st.fail(f"greedy answer ended with {answer.finish} {answer.error or ''}".strip())
    first = engine.stats.ttft.snapshot()  # the answer is this engine's first request
    ttft = first.sum / first.samples if first.samples else 0.0
    decode_s = max(answer.seconds - ttft, 1e-9)
    tps = (len(answer.ids) - 1) / decode_s if len(answer.ids) > 1 else 0.0
    st.data.update(answer=answer.text, ttft_s=ttft, tokens_per_s=tps, prompt_tokens=len(prompt))

    budget = _Run(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    rows.append(["max_tokens=4", budget.finish.value if budget.finish else "?", len(budget.ids), budget.text[:60]])
    if budget.finish != FinishReason.LENGTH or len(budget.ids) != 4:
        st.fail(f"a 4-token budget ended with {budget.finish} after {len(budget.ids)} tokens")
    _check_stop_string(engine, prompt, answer, st, rows)
    _check_schema(ctx, engine, st, rows)
    _check_tool_call(ctx, engine, st, rows)
    st.table(["request", "finish", "tokens", "text"], rows)
    st.note(f"TTFT {ttft * 1000:.0f} ms for {len(prompt)} prompt tokens; decode {tps:.1f} tokens/s")


def _check_stop_string(
    engine: Engine, prompt: list[int], answer: _Run, st: StageResult, rows: list[list[object]]
) -> None:
    text = answer.text.strip()
    if len(text) < 4:
        st.note("stop string not checked: the greedy answer is too short")
        return
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = _Run(engine, prompt, SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, stop=(stop,)))
    rows.append([f"stop={stop!r}", cut.finish.value if cut.finish else "?", len(cut.ids), cut.text[:60]])
    want = answer.text[: answer.text.find(stop)]
    if cut.finish != FinishReason.STOP or stop in cut.text or cut.text != want:
        st.fail(f"stop string {stop!r}: got {cut.text!r} ({cut.finish}), expected {want!r} (stop)")


def _check_schema(ctx: DoctorContext, engine: Engine, st: StageResult, rows: list[list[object]]) -> None:
    from tools.grammar import GrammarCompiler
    from tools.schema import validate_instance

    tok = ctx.loaded.tokenizer
    compiler = ctx.extras.get("compiler")
    if compiler is None:
        compiler = ctx.extras["compiler"] = GrammarCompiler(tok, ctx.loaded.config.vocab_size)
    question = [{"role": "user", "content": "Which country is Paris the capital of? Reply in JSON."}]
    ids = tok.apply_chat_template(question) if tok.chat_template else tok.encode(question[0]["content"])
    matcher = compiler.matcher(compiler.json_schema(SCHEMA, where="doctor schema"))
    run = _Run(engine, ids, SamplingParams(max_tokens=STRUCTURED_TOKENS, temperature=0.0), matcher)
    rows.append(["json schema", run.finish.value if run.finish else "?", len(run.ids), run.text[:60]])
    try:
        value = json.loads(run.text)
    except json.JSONDecodeError as e:
        st.fail(f"JSON-schema output is not JSON ({e}): {run.text[:80]!r}")
        return
    error = validate_instance(value, SCHEMA)
    if error is not None:
        st.fail(f"JSON-schema output violates its schema at {error[0]}: {error[1]}")


def _check_tool_call(ctx: DoctorContext, engine: Engine, st: StageResult, rows: list[list[object]]) -> None:
    from tools.calls import CallDone, ToolCallParser
    from tools.formats import detect_format
    from tools.prompt import render_prompt
    from tools.schema import parse_tools

    tok = ctx.loaded.tokenizer
    if not tok.chat_template:
        st.note("no chat template (a base model): the tool call is rendered with the built-in ChatML, as serve does")
    compiler = ctx.extras["compiler"]
    tools = parse_tools(TOOLS)
    fmt = detect_format(tok)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ids = render_prompt(tok, messages, tools)
    matcher = compiler.matcher(compiler.tool_calls(fmt, tools, "required", parallel_tool_calls=False))
    run = _Run(engine, ids, SamplingParams(max_tokens=STRUCTURED_TOKENS, temperature=0.0), matcher)
    parser = ToolCallParser(fmt, tools)
    calls = [e for e in parser.feed(run.text) + parser.finish() if isinstance(e, CallDone)]
    rows.append([f"tool call ({fmt.name})", run.finish.value if run.finish else "?", len(run.ids), run.text[:60]])
    if not calls:
        st.fail(f"no tool call parsed from {run.text[:80]!r} ({run.finish})")
    elif calls[0].error:
        st.fail(f"tool call invalid: {calls[0].error}")
    else:
        st.data["tool_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
