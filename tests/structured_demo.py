"""Shared by the structured-output tests: the demo model in the dtype `serve` picks on this CPU
(`--dtype auto`: bfloat16 where the CPU has fast bf16, float32 on an AVX2 CPU, where bf16 runs at
half float32's speed), loaded once per session, engines with the xgrammar hook, and the demo
tokenizer with a special-token call marker. These tests decode thousands of tokens: they run
what users get, at its speed."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import torch

from engine.engine import Engine, EngineConfig
from engine.loading.loader import LoadedModel, load
from engine.loading.model_source import ModelPath
from engine.loading.tokenizer import Tokenizer
from tests.cores import THREADS
from tools.grammar import GrammarCompiler, XGrammarHook

DEMO_VOCAB = 49152  # SmolLM2's vocab size = its logits width
SCHEMAS: dict[str, dict[str, Any]] = json.loads((Path(__file__).parent / "data" / "schemas20.json").read_text())


@functools.cache
def demo_served(path: str) -> LoadedModel:
    torch.set_num_threads(THREADS)
    return load(path, dtype="auto", progress=False)


@functools.cache
def compiler(path: str) -> GrammarCompiler:
    """The demo tokenizer's grammar compiler, without loading the model (mask tests need no weights)."""
    tokenizer = Tokenizer.load(ModelPath("gguf", Path(path), "demo"))
    return GrammarCompiler(tokenizer, DEMO_VOCAB)


def engine(lm: LoadedModel, max_num_seqs: int = 96) -> Engine:
    cfg = EngineConfig(kv_cache_bytes=3 << 29, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, threads=THREADS)
    return Engine(lm.model, lm.tokenizer, cfg, grammar_hook=XGrammarHook(max_threads=2))


def json_prompt(lm: LoadedModel, schema: dict[str, Any]) -> list[int]:
    """A chat prompt asking for one JSON value matching `schema` (shown to the model)."""
    messages = [
        {"role": "system", "content": "You answer with JSON only."},
        {"role": "user", "content": f"Give an example JSON value for this JSON schema:\n{json.dumps(schema)}"},
    ]
    return lm.tokenizer.apply_chat_template(messages)


def with_special_marker(demo_gguf: Path) -> Tokenizer:
    """The demo tokenizer with `[TOOL_CALLS]` added as a special token, as in Mistral's own."""
    hf = copy.deepcopy(compiler(str(demo_gguf)).tokenizer.hf)
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return Tokenizer(hf)


QWEN25_STYLE = (Path(__file__).parent / "data" / "qwen2_5_style_template.jinja").read_text()


def qwen_style(demo: Tokenizer) -> Tokenizer:
    """The demo tokenizer (it has ChatML's tokens) with a Qwen2.5-style template that renders tools."""
    hf = copy.deepcopy(demo.hf)
    hf.chat_template = QWEN25_STYLE
    tok = Tokenizer(hf, demo.eos_token_ids)
    assert tok.renders_tools
    return tok
