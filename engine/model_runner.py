"""Runs one forward pass for a batch of sequence chunks over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention import cpu_kernel
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.registry import make_backend
from engine.loading.model_source import longctx_home
from engine.model.model import CausalLM
from engine.model.vision.step import ChunkImages, gather_step
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec

if TYPE_CHECKING:
    from engine.verify.self_check import CompileReport


def build_kernels(device: torch.device) -> None:
    """On CPU, the attention kernels (`engine/attention/paged_decode.cpp`, `paged_prefill.cpp`),
    built once under `$LONGCTX_HOME/kernels`; backends made after this use them."""
    if device.type == "cpu":
        cpu_kernel.load(longctx_home() / "kernels")


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: `token_ids` are its next tokens, computed at positions
    `kv_len - len(token_ids) .. kv_len - 1`; `page_table` holds pages for `kv_len` tokens,
    from logical page `first_page` on (a sliding window released those before): a list, or
    an int32 tensor (a request's `PageTable.live()`, used without copying it into Python)."""

    token_ids: list[int]
    page_table: list[int] | torch.Tensor
    kv_len: int
    first_page: int = 0
    images: ChunkImages | None = None  # image features and M-RoPE positions of its tokens


class ModelRunner:
    """Owns the model, its KV tensors and the attention backend; one `run` = one forward pass."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, backend: AttentionBackend):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = model.model.norm.weight.device
        # The forward pass: the model itself, or a `CompiledStep` over it (`use_compiled`).
        self.step: Callable[..., torch.Tensor] = model
        self.num_forward_calls = 0
        self.num_tokens_computed = 0
        self.num_mixed_steps = 0  # steps whose batch held prefill chunks and decode tokens together
        self.last_plan: tuple[int, int] = (0, 0)  # (prefill chunks, decode tokens) of the last pass
        # Pipeline parallel: a step splits into at most this many micro-batches (default: stages).
        self.max_micro_batches = model.parallel.pp_size
        self.busy_s = self.wall_s = 0.0  # pipeline: this stage's compute and step time (bubble 1 - busy/wall)

    def check_compiled(self, buckets: tuple[int, ...] | None = None) -> CompileReport | None:
        """Compile and self-check the compiled step's `buckets` (None: all it compiles) before
        serving; a bucket that fails runs eager. None when this runner runs eager."""
        from engine.model.compiled import CompiledStep
        from engine.verify.self_check import warm_up_and_check

        if not isinstance(self.step, CompiledStep):
            return None
        return warm_up_and_check(self.step, self.kv_cache.spec.page_size, buckets)

    @classmethod
    def for_model(cls, model: CausalLM, page_size: int, kv_cache_bytes: int, attention_backend: str) -> ModelRunner:
        """A runner with a KV cache of `kv_cache_bytes` (this rank's heads, the model's dtype)."""
        mc = model.config
        device = model.model.norm.weight.device
        dtype = str(model.model.norm.weight.dtype).replace("torch.", "")
        spec = KVSpec(len(model.stage_layers), model.local_kv_heads, mc.head_dim, page_size, dtype)
        # Pipeline stages share one page table: pages for the budget of the stage with most layers.
        most = max(len(model.parallel.stage_layers(mc.num_layers, s)) for s in range(model.parallel.pp_size))
        pages = KVSpec(most, model.local_kv_heads, mc.head_dim, page_size, dtype).pages_in_budget(kv_cache_bytes)
        kv_cache = KVCache(spec, pages, device)
        build_kernels(device)
        backend = make_backend(attention_backend, device, model.local_heads, model.local_kv_heads, mc.head_dim)
        return cls(model, kv_cache, backend)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], all_logits: bool = False, bounds: list[int] | None = None) -> torch.Tensor:
        """Returns float32 logits: [B, V] for each chunk's last token, or [T, V] for every token.

        A pipeline stage (`engine/distributed/pipeline.py`) runs its layers over the micro-batches
        `chunks[bounds[i]:bounds[i + 1]]` (default: its own split); only global rank 0 gets the
        logits, the other stages an empty tensor."""
        if self.model.parallel.pipelined:
            from engine.distributed.pipeline import run_stage

            return run_stage(self, chunks, all_logits, bounds)
        meta, ids, logits_indices = self.inputs(chunks, all_logits)
        self.backend.plan(meta)
        if any(c.images is not None for c in chunks):
            offsets = meta.qo_indptr.tolist()
            parts = [(offsets[i], len(c.token_ids), c.images) for i, c in enumerate(chunks)]
            images = gather_step(parts, meta.positions, self.device)
            logits = self.step(ids, meta, self.kv_cache.layers, self.backend, logits_indices, images)
        else:
            logits = self.step(ids, meta, self.kv_cache.layers, self.backend, logits_indices)
        self.count(chunks)
        return logits

    def inputs(
        self, chunks: list[Chunk], all_logits: bool
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor | None]:
        """(the batch's metadata, its token ids [T] int64, the rows whose logits are wanted [N] or None: all)."""
        meta = AttentionMetadata.from_tables(
            [_table(c.page_table) for c in chunks],
            [c.first_page for c in chunks],
            [len(c.token_ids) for c in chunks],
            [c.kv_len for c in chunks],
            self.kv_cache.spec.page_size,
            self.device,
        )
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device)
        # Every chunk's last token, in order: none to pick when each chunk is one token (decodes).
        last_only = not all_logits and meta.num_tokens > len(chunks)
        logits_indices = meta.qo_indptr[1:].to(torch.int64) - 1 if last_only else None
        return meta, ids, logits_indices

    def count(self, chunks: list[Chunk]) -> None:
        """Record one forward pass over the step `chunks` in the runner's counters."""
        self.num_forward_calls += 1
        self.num_tokens_computed += sum(len(c.token_ids) for c in chunks)
        decodes = sum(1 for c in chunks if len(c.token_ids) == 1)
        self.last_plan = (len(chunks) - decodes, decodes)
        if decodes and decodes < len(chunks):
            self.num_mixed_steps += 1


def _table(pages: list[int] | torch.Tensor) -> torch.Tensor:
    return pages if isinstance(pages, torch.Tensor) else torch.tensor(pages, dtype=torch.int32)
