"""`longctx generate` end to end: the demo model, and a MoE checkpoint with a tokenizer."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from api.cli_tools import StructuredRun
from engine.engine import Engine, EngineConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.demo_answers import QUESTIONS
from tests.server import ROOT
from tests.structured_demo import with_special_marker
from tests.tiny_models import tiny_moe_with_demo_tokenizer


def _longctx(*args: str, defaults: bool = False) -> subprocess.CompletedProcess[str]:
    """`longctx generate`; eager unless `defaults` (what a user runs: dtype auto, the compiled step)
    or `--compile`, since the other tests here are about the command, not the step."""
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    eager = () if defaults or "--compile" in args else ("--no-compile",)
    cmd = [sys.executable, "-m", "api.cli", "generate", *eager, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)


@pytest.mark.slow
def test_generate_demo_chat_with_the_defaults(demo_gguf: Path) -> None:
    """`--dtype auto` (bf16 on this CPU when it is fast at it), the compiled step, this CPU's kernels,
    each bucket self-checked at its first use: the answer eager float32 gives (the other questions
    go to the served defaults, `tests/test_api_chat.py`, which load the model once for all)."""
    question, answer = QUESTIONS[0]
    out = _longctx("--model", "smollm2-135m-instruct", "--chat", "--max-tokens", "16", "--prompt", question,
                   defaults=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(answer), (out.stdout, out.stderr[-2000:])
    assert out.stdout.endswith("\n") and not out.stdout.endswith("\n\n")
    assert "loaded" in out.stderr and "tokens/s" in out.stderr  # logs go to stderr
    assert "self-checked" in out.stderr and "0 eager" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_moe_checkpoint_generates_through_cli(tmp_path: Path, demo_float32: Any) -> None:
    """A tiny random Qwen3-MoE with the demo tokenizer: the CLI prints transformers' greedy text."""
    prompt = "The quick brown fox"
    expected = tiny_moe_with_demo_tokenizer(tmp_path, demo_float32.tokenizer, prompt, 12)
    out = _longctx("--model", str(tmp_path), "--prompt", prompt, "--max-tokens", "12", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"


def test_stop_string_across_tokens_and_utf8(demo_float32: Any) -> None:
    """Stop strings cut the demo model's own output mid-token, whatever the batch around them."""
    tok = demo_float32.tokenizer
    engine = Engine(demo_float32.model, tok, EngineConfig(kv_cache_bytes=64 << 20))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Écris une phrase sur le café ☕ et le thé 茶."}])
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    h = engine.add_request(prompt, greedy)
    engine.run_until_idle()
    ids, text, _ = h.result()
    assert text == tok.decode(ids)
    # a stop string that starts inside one token and ends inside a later one
    bounds = {len(tok.decode(ids[:i])) for i in range(len(ids) + 1)}
    start = next(
        s for s in range(len(text) // 3, len(text) - 5)
        if s not in bounds and s + 5 not in bounds and any(s < b < s + 5 for b in bounds)
        and text[s : s + 5] not in text[:s]
    )  # fmt: skip
    stop = text[start : start + 5]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    handles = [engine.add_request(prompt, params), engine.add_request(prompt[:-3], greedy)]
    engine.run_until_idle()
    _, text2, reason = handles[0].result()
    assert reason == FinishReason.STOP
    assert text2 == text[: text.index(stop)] and stop not in text2


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.mark.slow
def test_generate_with_tools_and_json_schema(tmp_path: Path, demo_gguf: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(WEATHER))
    out = _longctx("--model", "smollm2-135m-instruct", "--chat", "--prompt", "What's the weather in Paris?",
                   "--tools", str(tools), "--tool-choice", "required", "--tool-call-format", "hermes",
                   "--no-parallel-tool-calls", "--max-tokens", "128")  # fmt: skip
    assert out.returncode == 0, out.stderr
    call = json.loads(out.stdout.strip().splitlines()[-1])
    assert call["name"] == "get_weather" and "error" not in call
    assert isinstance(json.loads(call["arguments"])["city"], str)

    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    out = _longctx("--model", "smollm2-135m-instruct", "--prompt", "The capital of France, as JSON:",
                   "--json-schema", str(tmp_path / "schema.json"), "--max-tokens", "48")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) == {"capital"}

    bad = [{"type": "function", "function": {"name": "oops", "parameters": {"type": "nonsense"}}}]
    tools.write_text(json.dumps(bad))
    out = _longctx("--model", "smollm2-135m-instruct", "--chat", "--prompt", "hi", "--tools", str(tools))
    assert out.returncode == 2 and "oops" in out.stderr and "Traceback" not in out.stderr
    assert "loaded" not in out.stderr  # refused before the model loads


def test_kv_tier_flags() -> None:
    import argparse

    from api.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    default = p.parse_args([])
    assert (default.kv_redis_max_pending_bytes, default.kv_lookup_timeout) == (256 << 20, 5.0)
    assert EngineConfig().kv_redis_max_pending_bytes == 256 << 20 and EngineConfig().kv_lookup_timeout_s == 5.0
    args = p.parse_args(["--kv-redis-max-pending-bytes", "64MiB", "--kv-lookup-timeout", "0.5"])
    assert (args.kv_redis_max_pending_bytes, args.kv_lookup_timeout) == (64 << 20, 0.5)
    # reading ahead: the pool's size up to 1 GiB by default, 0 = off, a size as given
    from api.engine_args import engine_config

    assert default.kv_prefetch_bytes is None and engine_config(default).kv_prefetch_bytes is None
    assert engine_config(p.parse_args(["--kv-prefetch-bytes", "0"])).kv_prefetch_bytes == 0
    assert engine_config(p.parse_args(["--kv-prefetch-bytes", "32MiB"])).kv_prefetch_bytes == 32 << 20
    with pytest.raises(ValueError, match="kv_prefetch_bytes"):
        EngineConfig(kv_prefetch_bytes=-1)


def test_structured_run_keeps_special_tokens_for_a_special_marker(tmp_path: Path, demo_gguf: Path) -> None:
    """`longctx generate` decodes with skip_special_tokens=False when the call marker is a special token."""
    tok = with_special_marker(demo_gguf)
    (tmp_path / "tools.json").write_text(json.dumps(WEATHER))
    for fmt, skip in [("mistral", False), ("hermes", True)]:
        args = argparse.Namespace(
            prompt="hi", json_schema=None, tools=tmp_path / "tools.json", tool_call_format=fmt,
            tool_choice="auto", no_parallel_tool_calls=False,
        )  # fmt: skip
        assert StructuredRun.from_args(args, tok, len(tok.hf)).skip_special_tokens is skip


def test_generate_checks_the_chosen_buckets_its_prompt_uses() -> None:
    """`generate` compiles and self-checks only the buckets its prompt's chunks and its decoding
    will run in, of those `--compile-buckets` chose (a step pads up to the next chosen one)."""
    from api.generate import _buckets
    from engine.model.compiled import BUCKETS

    assert _buckets(512, 37, BUCKETS) == [1, 64]
    assert _buckets(32, 70, BUCKETS) == [1, 8, 32]  # chunks of 32, 32 and 6
    assert _buckets(32, 70, (1, 64)) == [1, 64]
    assert _buckets(512, 100, (2, 8)) == [2]  # the prompt runs eager; decoding pads to 2
