"""A compiled decoder step: the per-layer regions of `regions.py` through `torch.compile`
(inductor), attention, embedding, final norm and LM head left eager.

Steps are padded to a static bucket of token counts (`BUCKETS`, or the subset `--compile-buckets`
chose); steps with more tokens run the eager model. Each region is one compiled function shared
by every layer (weights are inputs), so a model makes at most `regions x buckets` graphs,
compiled by `warm_up` (`serve`: in a background process, `engine/process/background_compile.py`;
buckets in `pending` run eager until switched in). A recompile past that is an error, never a
silent fall back to eager: `fail_on_recompile_limit_hit`.
Graphs are cached by inductor's FX graph cache under `$LONGCTX_HOME/compile/inductor`, and each
graph a layer is bound to is also kept in `$LONGCTX_HOME/compile/graphs` (`graph_store.py`), so a
second start loads them without tracing.

The MoE experts stay eager (data-dependent routing: per-expert token counts vary per step); an
MoE layer compiles o_proj -> residual -> norm and runs its sparse block eager. Under tensor
parallelism the post-attention region splits in two (`o_projection`, `mlp_block`) and the
all-reduces after the row-parallel linears run eager between the graphs; each layer's regions
are called directly once bound, as in one process, but the step goes region by region (the
all-reduces between). A pipeline stage compiles its own layers: the first embeds, the others
take the previous stage's hidden states, and every stage but the last returns the residual
stream (`CausalLM.stage_forward`'s contract). A rank's graphs go to the graph store too, and a
later start binds each layer from it as its warm-up step reaches it (`stored` answers False for
a rank: it looks up a whole model's pre/post pairs from token ids).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.model.compile_setup import prepare
from engine.model.direct import DirectCall, Region, current_store, signature
from engine.model.layers import DenseMLP
from engine.model.model import CausalLM, DecoderLayer
from engine.model.regions import (
    LinearSpec,
    linear_spec,
    mlp_block,
    o_projection,
    post_attention,
    pre_attention,
)
from engine.model.tp import gather_vocab
from engine.model.vision.step import StepImages, add_deepstack, merge_embeddings, rotary

log = logging.getLogger("longctx.compile")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(num_tokens: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest of `buckets` (sorted) holding `num_tokens`, or None past the largest (eager)."""
    for b in buckets:
        if num_tokens <= b:
            return b
    return None


def chosen_buckets(buckets: tuple[int, ...] | None) -> tuple[int, ...]:
    """`buckets` sorted and checked against `BUCKETS` (None: every one)."""
    if buckets is None:
        return BUCKETS
    chosen = tuple(sorted(set(buckets)))
    if not chosen or any(b not in BUCKETS for b in chosen):
        raise ValueError(f"compile buckets must be some of {','.join(map(str, BUCKETS))}, got {list(buckets)}")
    return chosen


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Region:
    return Region(fn, prepare)


class CompiledStep:
    """Callable like `CausalLM.forward`; runs the compiled regions for steps of up to 64 tokens."""

    def __init__(self, model: CausalLM, buckets: tuple[int, ...] | None = None):
        self.model = model
        # The step sizes this step compiles (`--compile-buckets`): a step runs padded to the
        # smallest that holds it; past the largest, eager.
        self.buckets = chosen_buckets(buckets)
        self.tp = model.parallel if model.parallel.sharded else None  # eager all-reduces between regions
        self.pre = _compiled(pre_attention)
        self.post = _compiled(post_attention)
        # by `which`: 0 = pre_attention, 1 = post_attention (or o_projection and 2 = mlp_block under TP)
        split = (_compiled(o_projection), _compiled(mlp_block))
        self.regions: tuple[Region, ...] = (self.pre, *split) if self.tp is not None else (self.pre, self.post)
        self.compiled_buckets: set[int] = set()
        # (bucket, layer, 0 = pre / 1 = post) -> the layer's graph called without dynamo.
        self.direct: dict[tuple[int, int, int], DirectCall | None] = {}
        # Layers call their bound graphs directly (`engine/model/direct.py`) once dynamo has run them;
        # a whole step through `_direct_layers` only in one process (its all-reduces stay in `_region`'s loop).
        self.use_direct = True
        # bucket -> every layer's (pre, post) direct calls, once all are bound.
        self.bound: dict[int, list[tuple[DirectCall, DirectCall]]] = {}
        cfg = model.config
        self.eps = cfg.rms_norm_eps
        self.layers: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []
        # Per layer: (layer index, sliding window) for attention, the eager MoE block or None.
        self.attention: list[tuple[int, int | None]] = []
        self.sparse: list[nn.Module | None] = []
        # This pipeline stage's layers (all of them in one process), in order.
        for layer in cast("list[DecoderLayer]", [model.model.layers[i] for i in model.stage_layers]):
            attn = layer.self_attn
            self.attention.append((attn.layer, attn.window))
            pre_args = (
                layer.input_layernorm.weight,
                linear_spec(attn.qkv_proj),
                None if attn.q_norm is None else attn.q_norm.weight,
                None if attn.k_norm is None else attn.k_norm.weight,
            )
            mlp: tuple[LinearSpec | None, LinearSpec | None] = (None, None)
            if isinstance(layer.mlp, DenseMLP):
                mlp = (linear_spec(layer.mlp.gate_up_proj), linear_spec(layer.mlp.down_proj))
            self.sparse.append(None if isinstance(layer.mlp, DenseMLP) else layer.mlp)
            post_args = (linear_spec(attn.o_proj), layer.post_attention_layernorm.weight, *mlp)
            self.layers.append((pre_args, post_args))
        self.heads = (model.local_heads, model.local_kv_heads, cfg.head_dim)
        self.windows = {window for _, window in self.attention}
        # Buckets that run the eager model instead (their graphs failed the self-check,
        # `engine/verify/self_check.py`): bucket -> why.
        self.eager_buckets: dict[int, str] = {}
        # Buckets that run eager until switched in (compiling in the background, then self-checked).
        self.pending: set[int] = set()
        # Called after every region call with (bucket, layer, 0 = pre / 1 = post, args, outputs)
        # while set; steps then go region by region (the same graphs), never `_direct_layers`.
        self.observer: Callable[[int, int, int, tuple[Any, ...], Any], None] | None = None

    def __call__(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        T = input_ids.shape[0]
        bucket = bucket_for(T, self.buckets)
        if bucket is None or bucket in self.eager_buckets or bucket in self.pending:
            return self.model(input_ids, meta, kv_caches, backend, logits_indices, images)
        m = self.model
        first, last = m.parallel.first_stage, m.parallel.last_stage
        pad = bucket - T
        positions = meta.positions
        if pad:  # token ids [T], or (a later pipeline stage) the previous stage's hidden states [T, hidden]
            input_ids = F.pad(input_ids, (0, pad) if first else (0, 0, 0, pad))
            positions = F.pad(positions, (0, pad))
        # Image features replace their placeholders' embeddings; M-RoPE positions give cos/sin;
        # DeepStack features join layers' outputs between regions (all eager, around the graphs).
        x = merge_embeddings(m.model.embed_tokens(input_ids), images) if first else input_ids  # [bucket, hidden]
        cos, sin = rotary(m.rope, positions, images, x.dtype)
        residual = torch.zeros_like(x)
        bound = self.bound.get(bucket)
        deepstack = images is not None and bool(images.deepstack)
        if (
            bound is not None and not pad and cos.is_contiguous() and sin.is_contiguous() and self.observer is None
            and not deepstack
        ):  # fmt: skip
            x, residual = self._direct_layers(bound, x, residual, cos, sin, kv_caches, backend)
        else:
            layers = zip(kv_caches, self.layers, self.attention, self.sparse, strict=True)
            for i, (cache, (pre_args, post_args), (index, window), sparse) in enumerate(layers):  # i: in this stage
                pre = (x, residual, *pre_args, cos, sin, self.heads, self.eps)
                q, kv, residual = self._region(bucket, i, 0, pre)
                if pad:
                    q, kv = q[:T], kv[:, :T]
                o = backend.forward(index, q, kv[0], kv[1], cache, window)  # [T, H, D]
                if pad:
                    o = F.pad(o, (0, 0, 0, 0, 0, pad))
                if self.tp is None:
                    x, residual = self._region(bucket, i, 1, (o, residual, *post_args, self.eps))
                else:
                    attn = self.tp.all_reduce(self._region(bucket, i, 1, (o, post_args[0])))
                    x, residual = self._region(bucket, i, 2, (attn, residual, *post_args[1:], self.eps))
                    if sparse is None:  # the dense MLP's down projection is row-parallel too
                        x = self.tp.all_reduce(x)
                if sparse is not None:
                    x = sparse(x)
                if deepstack:
                    x = add_deepstack(x, images, index)
            calls = [
                (self.direct.get((bucket, i, 0)), self.direct.get((bucket, i, 1))) for i in range(len(self.layers))
            ]
            if self.use_direct and self.tp is None and all(pre is not None and post is not None for pre, post in calls):
                self.bound[bucket] = cast("list[tuple[DirectCall, DirectCall]]", calls)
        if not last:  # the residual stream for the next stage, summed as its first norm would
            h = x + residual
            self.compiled_buckets.add(bucket)
            return h[:T] if pad else h
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        elif pad:
            x, residual = x[:T], residual[:T]
        h = x + residual
        logits = m.head(m.model.norm(h))  # [N, V] float32 ([N, V_local] under tensor parallelism)
        if self.tp is not None:
            logits = gather_vocab(logits, m.config.vocab_size, self.tp)
        self.compiled_buckets.add(bucket)
        return logits

    def _direct_layers(
        self,
        bound: list[tuple[DirectCall, DirectCall]],
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer of an unpadded step through its bound graphs; (x, residual) after the last.
        Attention goes through the backend's `fast_decode` where it has one for this step."""
        fast = {w: backend.fast_decode(w, x.dtype) for w in self.windows}
        layers = zip(kv_caches, bound, self.attention, self.sparse, strict=True)
        for cache, (pre, post), (index, window), sparse in layers:
            if not (x.is_contiguous() and residual.is_contiguous()):
                x, residual = x.contiguous(), residual.contiguous()
            q, kv, residual = pre(x, residual, cos, sin)
            attend = fast[window]
            if attend is not None:
                o = attend(q, kv[0], kv[1], cache)
            else:
                o = backend.forward(index, q, kv[0], kv[1], cache, window)  # [T, H, D]
            x, residual = post(o if o.is_contiguous() else o.contiguous(), residual)
            if sparse is not None:
                x = sparse(x)
        return x, residual

    def _region(self, bucket: int, layer: int, which: int, args: tuple[Any, ...]) -> Any:
        """Layer `layer`'s call of region `which` (0 = pre_attention, 1 = post_attention; under
        tensor parallelism 1 = o_projection, 2 = mlp_block), whose
        activations (x and residual, or o and residual; and cos, sin) change per step; the graph
        is called directly once a call through dynamo has bound it (`engine/model/direct.py`)."""
        key = (bucket, layer, which)
        if which == 0:
            dynamic: tuple[int, ...] = (0, 1, len(args) - 4, len(args) - 3)  # x, residual, cos, sin
        else:  # o and residual (o alone into the tensor-parallel o_projection)
            dynamic = (0,) if self.tp is not None and which == 1 else (0, 1)
        single = self.tp is not None and which == 1
        call = self.direct.get(key)
        region = self.regions[which]
        if call is not None and all(args[i].is_contiguous() for i in dynamic):
            out = call(*(args[i] for i in dynamic))
        elif not self.use_direct or key in self.direct:
            out = region(*args)
        else:
            out, self.direct[key] = region.call_and_bind(args, dynamic)
        if single and isinstance(out, list | tuple):  # a graph's outputs come as a list; o_projection has one
            out = out[0]
        if self.observer is not None:
            self.observer(bucket, layer, which, args, out)
        return out

    def warm_up(self, page_size: int, buckets: tuple[int, ...] | None = None) -> float:
        """Compile (or load from the cache) every bucket's graphs by running a throwaway step of
        that many tokens over a scratch KV cache; a bucket whose graphs are all in the graph
        store is not run (its layers bind from the store at its first step, without tracing).
        Returns the seconds it took."""
        from engine.attention.torch_paged import TorchPagedBackend

        t0 = time.perf_counter()
        buckets = self.buckets if buckets is None else buckets
        m = self.model
        cfg = m.config
        dtype = m.model.norm.weight.dtype
        device = m.model.norm.weight.device
        backend = TorchPagedBackend(m.local_heads, m.local_kv_heads, cfg.head_dim)
        stored = [b for b in buckets if self.stored(b)]
        for b in buckets:
            if b in stored:
                continue
            pages = -(-b // page_size)
            caches = [
                torch.zeros(pages, 2, page_size, m.local_kv_heads, cfg.head_dim, dtype=dtype, device=device)
                for _ in self.layers
            ]
            meta = AttentionMetadata.build([list(range(pages))], [b], [b], page_size, device)
            backend.plan(meta)
            with torch.inference_mode():
                self(self.scratch_input(b), meta, caches, backend)
        seconds = time.perf_counter() - t0
        calls = [(b, w, call.stored) for (b, _, w), call in self.direct.items() if call is not None]
        traced = len({(b, w) for b, w, from_store in calls if not from_store})
        loaded = len({(b, w) for b, w, from_store in calls if from_store and b not in stored})
        log.info(
            "compiled %d step buckets in %.1fs: %d graphs traced, %d bound from %s at the warm-up step, "
            "%d buckets' graphs found there whole",
            len(buckets), seconds, traced, loaded, current_store() or "no store", len(stored),
        )  # fmt: skip
        return seconds

    def scratch_input(self, bucket: int) -> torch.Tensor:
        """A step's input of `bucket` zeros: token ids, or (a later pipeline stage) hidden states."""
        norm = self.model.model.norm.weight
        if self.model.parallel.first_stage:
            return torch.zeros(bucket, dtype=torch.int64, device=norm.device)
        return torch.zeros(bucket, self.model.config.hidden_size, dtype=norm.dtype, device=norm.device)

    @torch.inference_mode()
    def stored(self, bucket: int) -> bool:
        """Whether the graph store holds every graph an unpadded step of `bucket` tokens calls,
        judged on the arguments such a step passes its regions (built, not run)."""
        store = current_store()
        if store is None or not self.use_direct or self.model.parallel.distributed:  # a rank's: see the module doc
            return False
        m = self.model
        device = m.model.norm.weight.device
        x = m.model.embed_tokens(torch.zeros(bucket, dtype=torch.int64, device=device))
        cos, sin = m.rope.cos_sin(torch.arange(bucket, device=device), x.dtype)
        residual = torch.zeros_like(x)
        o = torch.empty(bucket, *self.heads[:1], self.heads[2], dtype=x.dtype, device=device)
        for pre_args, post_args in self.layers:
            pre = (x, residual, *pre_args, cos, sin, self.heads, self.eps)
            post = (o, residual, *post_args, self.eps)
            if not (store.has(self.pre.fn, signature(pre)) and store.has(self.post.fn, signature(post))):
                return False
        return True
