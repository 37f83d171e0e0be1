"""Long sessions on a model whose every layer has a sliding window: a 64k-token prompt through
`Engine` with pages released behind the window (device pages held stay bounded at every step),
and greedy tokens equal to transformers recomputing the window's receptive field at the same
absolute positions. Also: a decode step's Python work does not grow with the context."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from tests.test_prefix import page_bytes
from tests.tiny_models import TinyModel, build_tiny, one_thread

WINDOW = 256
PAGE = 16
PROMPT = 65_536
NEW = 8
CHUNK = 512  # max_num_batched_tokens
LAYERS = 2
BOUND = -(-WINDOW // PAGE) + 2  # device pages one windowed sequence holds between steps, at any length

_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return windowed_mistral(tmp_path_factory.mktemp("long-window"))


def windowed_mistral(path: Any) -> TinyModel:
    """Hidden 64, 2 layers, 4 heads and 1 KV head of 16 dims: 256 B of KV per token in float32."""
    return build_tiny(
        MistralConfig,
        MistralForCausalLM,
        path,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=WINDOW,
        max_position_embeddings=2 * PROMPT,
    )


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_greedy(t: TinyModel, ids: list[int], n: int) -> list[int]:
    """transformers (float32) over the last `LAYERS * WINDOW` tokens only, at their absolute
    positions: with a window on every layer, the last position's logits depend on the last
    LAYERS * (WINDOW - 1) + 1 tokens alone, so this recomputation from scratch is exact."""
    keep = LAYERS * WINDOW
    ctx = list(ids[-keep:])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            start = len(ids) + len(out) - len(ctx)
            pos = torch.arange(start, start + len(ctx))[None]
            logits = t.ref(torch.tensor([ctx]), position_ids=pos, use_cache=False).logits[0, -1]
            out.append(int(logits.argmax()))
            ctx = ctx[1:] + out[-1:]
    return out


def drive(engine: Engine, each_step: Callable[[], None] | None = None) -> None:
    while engine.has_unfinished():
        engine.step()
        if each_step is not None:
            each_step()


def test_64k_prompt_holds_window_pages_and_matches_reference(windowed: TinyModel) -> None:
    t = windowed
    pool_pages = 64  # 1,024 tokens of KV for a 65,544-token sequence
    cfg = EngineConfig(kv_cache_bytes=pool_pages * page_bytes(t.config), page_size=PAGE, max_num_batched_tokens=CHUNK)
    engine = Engine(t.model, None, cfg)
    assert engine.reclaim_window == WINDOW
    assert engine.capacity_tokens >= PROMPT + NEW  # admitted although 64 pages hold 1k tokens
    prompt = random_ids(t.config.vocab_size, PROMPT, seed=3)
    h = engine.add_request(prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    held: list[int] = []

    def sample() -> None:
        snap = engine.snapshot()
        held.append(max(snap.request_pages.values(), default=0))
        assert snap.held_pages == held[-1]  # one request: every page held is its own

    drive(engine, sample)
    ids, _, _ = h.result()
    assert len(held) == PROMPT // CHUNK + NEW - 1  # the last prefill chunk samples the first token
    assert max(held) <= BOUND, f"held {max(held)} pages > {BOUND}"
    # Within a step a prefill chunk's own pages come on top of the window's.
    assert engine.scheduler.peak_request_pages <= -(-(WINDOW + CHUNK - 1) // PAGE) + 1
    assert engine.scheduler.num_reclaimed_pages >= (PROMPT - WINDOW) // PAGE - 1
    assert ids == reference_greedy(t, prompt, NEW)


def _line_counter() -> tuple[Callable[[], int], Callable[[], None], Callable[[], None]]:
    """Counts Python line events (in every frame) between start() and stop(): the interpreted work."""
    count = [0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
        return tracer

    def start() -> None:
        count[0] = 0
        sys.settrace(tracer)

    def stop() -> None:
        sys.settrace(None)

    return lambda: count[0], start, stop


def _decode_lines(engine: Engine, prompt: list[int], steps: int) -> Iterator[tuple[int, int]]:
    """(Python lines, page hashes computed) of each of `steps` decode steps after this prompt."""
    read, start, stop = _line_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
    engine.step()  # takes the request in and computes its first chunk
    while any(r.num_computed < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()  # prefill
    engine.step()  # the first decode step
    for _ in range(steps):
        hashes = sum(len(v) for v in engine.scheduler._hashes.values())
        start()
        engine.step()
        stop()
        yield read(), sum(len(v) for v in engine.scheduler._hashes.values()) - hashes
    drive(engine)


@pytest.mark.parametrize("window", [True, False])
def test_decode_step_python_work_is_independent_of_context(windowed: TinyModel, window: bool) -> None:
    """Count the work, not the clock: a whole engine step (scheduler, page table, attention
    metadata and plan, model, sampler) runs the same Python lines after 2k and 16k tokens, and
    hashes at most the one page that filled. (Both are past `SPLIT_FROM`, where one decoding
    sequence's attention switches to split keys: more lines, but as many at any length.)"""
    t = windowed
    cfg = EngineConfig(kv_cache_bytes=1100 * page_bytes(t.config), page_size=PAGE, max_num_batched_tokens=4096)
    engine = Engine(t.model, None, cfg)
    layers: Any = t.model.model.layers
    if not window:  # the same model attending to everything: every page kept
        engine.scheduler.window = None
        for layer in layers:
            layer.self_attn.window = None
    try:
        steps = 2 * PAGE  # two pages fill, two tables grow
        short = list(_decode_lines(engine, random_ids(t.config.vocab_size, 2_000, seed=4), steps))
        long = list(_decode_lines(engine, random_ids(t.config.vocab_size, 16_000, seed=5), steps))
    finally:
        for layer in layers:
            layer.self_attn.window = WINDOW
    assert sum(n for _, n in short) == sum(n for _, n in long) == 2
    assert max(n for _, n in long) == 1
    lines_short = sorted(n for n, _ in short)
    lines_long = sorted(n for n, _ in long)
    # Identical steps run identical lines; a step that fills a page or grows a table runs a few more.
    assert lines_long[steps // 2] == lines_short[steps // 2], (lines_short, lines_long)
    assert max(lines_long) <= max(lines_short) + 20, (lines_short, lines_long)


def test_mixed_full_and_windowed_layers_keep_every_page(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Qwen2 with layer 0 full and layer 1 windowed: the full layer reads every page, so none is
    released, and the engine says so when it starts."""
    t = build_tiny(
        Qwen2Config, Qwen2ForCausalLM, tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    assert t.config.sliding_windows == (None, 8)
    with caplog.at_level(logging.INFO, logger="longctx.engine"):
        engine = Engine(t.model, None, EngineConfig(kv_cache_bytes=64 * page_bytes(t.config), page_size=PAGE))
    assert engine.reclaim_window is None
    assert "every KV page is kept" in caplog.text
    h = engine.add_request(
        random_ids(t.config.vocab_size, 100, seed=9), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    drive(engine)
    assert len(h.result()[0]) == 4
    assert engine.scheduler.num_reclaimed_pages == 0 and engine.scheduler.peak_request_pages == -(-103 // PAGE)
