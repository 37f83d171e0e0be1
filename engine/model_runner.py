"""Runs one forward pass for a batch of sequence chunks over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import cpu_kernel
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.registry import make_backend
from engine.loading.model_source import longctx_home
from engine.model.model import CausalLM
from engine.model.vision.step import ChunkImages, gather_step
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec


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

    @classmethod
    def for_model(cls, model: CausalLM, page_size: int, kv_cache_bytes: int, attention_backend: str) -> ModelRunner:
        """A runner with a KV cache of `kv_cache_bytes` (this rank's heads, the model's dtype)."""
        mc = model.config
        device = model.model.norm.weight.device
        dtype = str(model.model.norm.weight.dtype).replace("torch.", "")
        spec = KVSpec(mc.num_layers, model.local_kv_heads, mc.head_dim, page_size, dtype)
        kv_cache = KVCache.from_budget(spec, kv_cache_bytes, device)
        build_kernels(device)
        backend = make_backend(attention_backend, device, model.local_heads, model.local_kv_heads, mc.head_dim)
        return cls(model, kv_cache, backend)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], all_logits: bool = False) -> torch.Tensor:
        """Returns float32 logits: [B, V] for each chunk's last token, or [T, V] for every token."""
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
        self.backend.plan(meta)
        if any(c.images is not None for c in chunks):
            offsets = meta.qo_indptr.tolist()
            parts = [(offsets[i], len(c.token_ids), c.images) for i, c in enumerate(chunks)]
            images = gather_step(parts, meta.positions, self.device)
            logits = self.step(ids, meta, self.kv_cache.layers, self.backend, logits_indices, images)
        else:
            logits = self.step(ids, meta, self.kv_cache.layers, self.backend, logits_indices)
        self.num_forward_calls += 1
        self.num_tokens_computed += meta.num_tokens
        decodes = sum(1 for q in meta.q_lens if q == 1)
        self.last_plan = (len(chunks) - decodes, decodes)
        if decodes and decodes < len(chunks):
            self.num_mixed_steps += 1
        return logits


def _table(pages: list[int] | torch.Tensor) -> torch.Tensor:
    return pages if isinstance(pages, torch.Tensor) else torch.tensor(pages, dtype=torch.int32)
