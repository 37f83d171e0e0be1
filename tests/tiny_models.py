"""Tiny random transformers models, saved and reloaded by our loader, and ways to run them.

Shared by the differential tests: each builds a reference model with transformers, saves
it with `save_pretrained`, loads it with `engine.loading.weights`, and compares logits computed
through our paged runner against transformers' full-sequence forward without cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention.torch_paged import TorchPagedBackend
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.config import ModelConfig
from engine.model.model import CausalLM
from engine.model_runner import Chunk, ModelRunner
from kvstore.block_pool import BlockPool
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=160,
    max_position_embeddings=512,
)


@dataclass
class TinyModel:
    ref: Any  # the transformers model (float32, eval)
    path: Path
    config: ModelConfig
    model: CausalLM


def build_tiny(
    config_cls: type, model_cls: type, tmp: Path, *, seed: int = 0, max_shard_size: str | None = None, **kwargs: Any
) -> TinyModel:
    """Random transformers model from `config_cls(**SMALL | kwargs)`, saved and loaded back by us."""
    torch.manual_seed(seed)
    hf_config = config_cls(**(SMALL | kwargs))
    ref = model_cls(hf_config).eval()
    _randomize_norms_and_biases(ref)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    ref.save_pretrained(tmp, **save_kwargs)
    config = ModelConfig.from_pretrained_dir(tmp)
    model, _ = load_model(config, SafetensorsSource(tmp), torch.float32, progress=False)
    return TinyModel(ref, tmp, config, model)


def _randomize_norms_and_biases(ref: Any) -> None:
    """transformers initialises norm weights to ones and biases to zeros; random ones catch a
    missed norm or bias."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))


def reference_logits(ref: Any, ids: list[int]) -> torch.Tensor:
    """transformers' full-sequence forward, no cache: [T, V] float32."""
    with torch.no_grad():
        return ref(torch.tensor([ids]), use_cache=False).logits[0].float()


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The error measure used everywhere: max|ours - ref| / max|ref|."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def make_runner(config: ModelConfig, model: CausalLM, num_pages: int = 256, page_size: int = 16) -> ModelRunner:
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    spec = KVSpec(config.num_layers, config.num_kv_heads, config.head_dim, page_size, dtype)
    return ModelRunner(
        model, KVCache(spec, num_pages), TorchPagedBackend(config.num_heads, config.num_kv_heads, config.head_dim)
    )


def run_chunked(runner: ModelRunner, pool: BlockPool, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits for every position, computing `chunk` tokens per step (chunk >= len(ids) = one step)."""
    page_size = runner.kv_cache.spec.page_size
    pages = pool.allocate(-(-len(ids) // page_size))
    try:
        outs = []
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            outs.append(runner.run([Chunk(part, pages, start + len(part))], all_logits=True))
        return torch.cat(outs)
    finally:
        pool.free(pages)


def run_mixed_step(runner: ModelRunner, pool: BlockPool, prompts: list[list[int]], split: int) -> list[torch.Tensor]:
    """Prompt 0 prefills in two chunks; prompts 1.. are prefilled except their last token. Then one
    step computes prompt 0's second chunk together with the others' last (decode) token.
    Returns, per prompt, the logits of the tokens computed in that mixed step."""
    page_size = runner.kv_cache.spec.page_size
    tables = [pool.allocate(-(-len(p) // page_size)) for p in prompts]
    try:
        first = [Chunk(prompts[0][:split], tables[0], split)]
        first += [Chunk(p[:-1], t, len(p) - 1) for p, t in zip(prompts[1:], tables[1:], strict=True)]
        runner.run(first)
        mixed = [Chunk(prompts[0][split:], tables[0], len(prompts[0]))]
        mixed += [Chunk(p[-1:], t, len(p)) for p, t in zip(prompts[1:], tables[1:], strict=True)]
        logits = runner.run(mixed, all_logits=True)
        if logits.numel() == 0:  # a pipeline stage other than rank 0's: the logits went there
            return []
        sizes = [len(c.token_ids) for c in mixed]
        return list(logits.split(sizes))
    finally:
        for t in tables:
            pool.free(t)


def check_mixed_step(tiny: TinyModel, prompts: list[list[int]], threshold: float, page_size: int = 16) -> None:
    """prompts[2] prefills its second chunk in the same step as prompts[0] and [1] decode; all match."""
    runner = make_runner(tiny.config, tiny.model, page_size=page_size)
    pool = BlockPool(runner.kv_cache.num_pages)
    ordered = [prompts[2], prompts[0], prompts[1]]
    split = 20
    outs = run_mixed_step(runner, pool, ordered, split)
    assert rel_error(outs[0], reference_logits(tiny.ref, ordered[0])[split:]) < threshold
    for p, out in zip(ordered[1:], outs[1:], strict=True):
        assert rel_error(out, reference_logits(tiny.ref, p)[-1:]) < threshold


def check_greedy_matches(tiny: TinyModel, prompts: list[list[int]], max_tokens: int = 32) -> None:
    """Our batched greedy tokens equal transformers' `generate` for each prompt alone."""
    ours = engine_greedy(tiny.model, prompts, max_tokens)
    tiny.ref.generation_config.eos_token_id = None
    tiny.ref.generation_config.pad_token_id = 0
    for ids, out in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = tiny.ref.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens
            )
        assert out == ref[0, len(ids) :].tolist()


def engine_greedy(
    model: CausalLM,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    tokenizer: Any = None,
    page_size: int = 16,
    num_pages: int = 256,
) -> list[list[int]]:
    """Greedy tokens for every prompt, batched through the serving `Engine` (the code users run).
    Without a tokenizer, end-of-sequence is ignored (transformers' reference runs without one)."""
    from engine.engine import Engine, EngineConfig
    from engine.sampling_params import SamplingParams
    from kvstore.spec import KVSpec

    mc = model.config
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    spec = KVSpec(mc.num_layers, model.local_kv_heads, mc.head_dim, page_size, dtype)
    config = EngineConfig(
        kv_cache_bytes=num_pages * spec.bytes_per_page, page_size=page_size, attention_backend="torch_paged",
        max_num_batched_tokens=max(512, sum(len(p) for p in prompts)),
    )  # fmt: skip
    engine = Engine(model, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=tokenizer is None)
    handles = [engine.add_request(p, params) for p in prompts]
    engine.run_until_idle()
    assert engine.pool.num_free == engine.pool.num_pages
    return [h.result()[0] for h in handles]


def check_logits_all_chunkings(
    tiny: TinyModel, prompts: list[list[int]], threshold: float, page_size: int = 16
) -> None:
    """Each prompt whole, in chunks of 5, and one token per step: logits match transformers'."""
    runner = make_runner(tiny.config, tiny.model, page_size=page_size)
    pool = BlockPool(runner.kv_cache.num_pages)
    for ids in prompts:
        ref = reference_logits(tiny.ref, ids)
        for chunk in (len(ids), 5, 1):
            err = rel_error(run_chunked(runner, pool, ids, chunk), ref)
            assert err < threshold, f"chunk={chunk} len={len(ids)}: error {err:.2e}"
    assert pool.num_free == pool.num_pages


def one_thread() -> Iterator[None]:
    """For a module-scoped autouse fixture: tiny models run fastest on one thread, and far faster
    than with many on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_moe_with_demo_tokenizer(tmp: Path, tokenizer: Any, prompt: str, max_tokens: int) -> str:
    """A tiny random Qwen3-MoE saved with the demo tokenizer into `tmp`; returns transformers'
    greedy continuation of `prompt` (the text a CLI run on `tmp` must print)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tiny = build_tiny(
        Qwen3MoeConfig, Qwen3MoeForCausalLM, tmp, vocab_size=49152, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, decoder_sparse_step=1,
    )  # fmt: skip
    tokenizer.hf.save_pretrained(tmp)
    ids = tokenizer.encode(prompt)
    tiny.ref.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = tiny.ref.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens
        )
    return str(tokenizer.decode(ref[0, len(ids) :].tolist()))


def llama_with_demo_tokenizer(path: Path, demo_gguf: Path, **config: Any) -> Path:
    """A random Llama (tied embeddings, the demo's vocabulary; `config` gives the sizes) saved
    into `path` with the demo tokenizer and chat template: a checkpoint `longctx serve` loads
    as it would a real one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loading.gguf_cache import GGUFCache
    from engine.loading.loader import load_tokenizer
    from engine.loading.model_source import resolve_model

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **config)).save_pretrained(path)
    load_tokenizer(resolve_model(str(demo_gguf)), (), GGUFCache(demo_gguf)).hf.save_pretrained(path)
    return path
