"""The model through our runner and `Engine` on a GPU, per attention backend (for `gpu_check.py`).

A random Llama (2 layers, 4 query heads and 1 KV head of head dim 128, so FlashInfer runs the
same kernel families as the attention cases) is built with transformers, saved, and loaded by
our loader in the checked dtype onto the device. Per backend:

- logits: two prompts (45 and 900 tokens) run through `ModelRunner` whole, in chunks of 64, and
  their last 16 tokens one decode step at a time, against transformers' float32 forward of the
  same checkpoint on the same device (max|ours - ref| / max|ref|; the bounds of
  `tests/test_model_dense.py`'s dtype test: bfloat16 2e-2, float16 3e-3);
- the engine: 16 prompts of 20-600 tokens, greedy, 64 tokens each, batched by `Engine` (mixed
  prefill and decode steps), timed; each backend's tokens compared with the first backend's
  and with transformers' float32 greedy tokens (identical sequences, and the mean number of
  tokens before the first difference: in bf16 near-ties of a random model's logits flip).

On CPU (`gpu_check.py --cpu-selftest`) a smaller model and load, torch_paged alone. Needs
transformers and longctx's engine dependencies; where they are missing the row says which.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODEL: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=128,
    vocab_size=1024,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
CPU_MODEL = MODEL | dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)
THRESHOLDS = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}
PAGE = 16


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _agreement(ours: list[list[int]], ref: list[list[int]]) -> str:
    """'identical sequences / all, mean tokens before the first difference'."""
    same = sum(a == b for a, b in zip(ours, ref, strict=True))
    mean = sum(_prefix(a, b) for a, b in zip(ours, ref, strict=True)) / len(ref)
    return f"{same}/{len(ref)}, {mean:.1f}"


def _greedy_reference(ref: Any, batch: list[list[int]], max_tokens: int, device: torch.device) -> list[list[int]]:
    """transformers' float32 greedy tokens, each prompt alone."""
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for ids in batch:
            x = torch.tensor([ids], device=device)
            y = ref.generate(x, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def _logits_by(runner: Any, ids: list[int], chunk: int, decode_tail: int) -> torch.Tensor:
    """Logits of every position: `chunk` tokens per step, then the last `decode_tail` one per step."""
    from engine.model_runner import Chunk
    from kvstore.block_pool import BlockPool

    pool = BlockPool(runner.kv_cache.num_pages)
    pages = pool.allocate(-(-len(ids) // PAGE))
    head = len(ids) - decode_tail
    bounds = [*range(0, head, chunk), *range(head, len(ids))]
    outs = []
    for start, end in zip(bounds, [*bounds[1:], len(ids)], strict=True):
        outs.append(runner.run([Chunk(ids[start:end], pages, end)], all_logits=True))
    return torch.cat(outs)


def engine_rows(device: torch.device, backends: list[str], dtypes: list[torch.dtype]) -> list[dict[str, Any]]:
    """One row per (dtype, backend): the logits' error and the engine's greedy run."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from engine.engine import Engine
        from engine.engine_config import EngineConfig
        from engine.loading.weights import SafetensorsSource, load_model
        from engine.model_runner import ModelRunner
        from engine.sampling_params import SamplingParams
        from engine.verify.agreement import rel_error
        from tests.tiny_models import build_tiny
    except ImportError as e:
        return [{"case": "engine", "skipped": f"needs longctx's engine dependencies: {e}"}]

    small = device.type == "cpu"  # the self-test: a smaller model and load
    g = torch.Generator().manual_seed(7)
    vocab = MODEL["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in ((45, 200) if small else (45, 900))]
    lengths = torch.randint(20, 100 if small else 600, (8 if small else 16,), generator=g).tolist()
    batch = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    max_tokens = 16 if small else 64
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny(LlamaConfig, LlamaForCausalLM, Path(tmp), **(CPU_MODEL if small else MODEL))
        ref = tiny.ref.to(device)  # float32, random norms: a missed norm shows
        with torch.no_grad():
            expected = [ref(torch.tensor([p], device=device), use_cache=False).logits[0].float() for p in prompts]
        greedy32 = _greedy_reference(ref, batch, max_tokens, device)
        for dtype in dtypes:
            model, _ = load_model(tiny.config, SafetensorsSource(Path(tmp)), dtype, device, progress=False)
            first: list[list[int]] | None = None
            for name in backends:
                row: dict[str, Any] = {"case": "engine", "dtype": str(dtype).replace("torch.", ""), "backend": name}
                try:
                    runner = ModelRunner.for_model(model, PAGE, 64 << 20, name)
                    errs = [
                        rel_error(_logits_by(runner, p, chunk, 16), exp)
                        for p, exp in zip(prompts, expected, strict=True)
                        for chunk in (len(p), 64)
                    ]
                    del runner
                    engine = Engine(
                        model, None,
                        EngineConfig(kv_cache_bytes=256 << 20, page_size=PAGE, attention_backend=name,
                                     max_num_batched_tokens=2048),
                    )  # fmt: skip
                    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                    sync_device(device)
                    t0 = time.perf_counter()
                    handles = [engine.add_request(p, params) for p in batch]
                    engine.run_until_idle()
                    sync_device(device)
                    seconds = time.perf_counter() - t0
                    tokens = [h.result()[0] for h in handles]
                    del engine
                except Exception as e:  # a failed row; the other backends and dtypes still run
                    rows.append(row | {"ok": False, "failure": f"{type(e).__name__}: {e}"[:2000]})
                    continue
                first = first or tokens
                err = max(errs)
                rows.append(
                    row
                    | {
                        "error": err,
                        "threshold": THRESHOLDS[dtype],
                        "ok": err < THRESHOLDS[dtype],
                        "engine_seconds": seconds,
                        "engine_tokens_per_s": sum(len(t) for t in tokens) / seconds,
                        "greedy_vs_first_backend": _agreement(tokens, first),
                        "greedy_vs_float32": _agreement(tokens, greedy32),
                    }
                )
            del model
    return rows
