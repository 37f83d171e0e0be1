"""The decoder: one forward pass over a flat batch of tokens from many sequences.

Llama, Mistral, Qwen2 and Qwen3 (and their MoE variants, whose sparse block lives in
`engine/model/moe.py`) share this structure; their differences are config flags (q/k/v bias,
q/k norm, sliding windows, the MLP kind per layer). Projections are fused (QKV, gate+up);
the checkpoint's separate tensors are loaded into slices of them (`shard_specs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.parallel import SINGLE, ParallelContext
from engine.model.config import ModelConfig
from engine.model.head import head_logits
from engine.model.layers import OTHER_RANK, DenseMLP, RMSNorm, ShardIndex, add_rms_norm, set_shards
from engine.model.moe import SparseMoE
from engine.model.rope import RotaryEmbedding, apply_rotary
from engine.model.tp import (
    SourceSlice,
    VocabParallelEmbedding,
    gather_vocab,
    rows,
    set_other_rank,
    set_source_slices,
    split_heads,
)
from engine.model.vision.encoder import ImageEncoder
from engine.model.vision.step import StepImages, add_deepstack, merge_embeddings, rotary

# Older spellings of module paths in checkpoints, rewritten before mapping a name.
CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."),)  # Mixtral as saved by transformers


class Attention(nn.Module):
    """Under tensor parallelism this rank's heads only (`split_heads`): QKV split by output rows,
    o_proj by input columns, then one all-reduce; o_proj's bias lives on rank 0 only."""

    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.layer = layer
        self.parallel = parallel
        heads = split_heads(config.num_heads, config.num_kv_heads, parallel)
        self.num_heads = heads.heads
        self.num_kv_heads = heads.kv_heads
        self.head_dim = D = config.head_dim
        self.window = config.window(layer)
        q_size, kv_size = heads.heads * D, heads.kv_heads * D
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias and parallel.rank == 0)
        self.q_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        parts: dict[object, ShardIndex] = {
            "q": (slice(0, q_size),),
            "k": (slice(q_size, q_size + kv_size),),
            "v": (slice(q_size + kv_size, q_size + 2 * kv_size),),
        }
        set_shards(self.qkv_proj, "weight", parts)
        if self.qkv_proj.bias is not None:
            set_shards(self.qkv_proj, "bias", parts)
        if parallel.sharded:
            src: dict[object, SourceSlice] = {
                "q": rows(heads.q_start * D, q_size),
                "k": rows(heads.kv_start * D, kv_size),
                "v": rows(heads.kv_start * D, kv_size),
            }
            set_source_slices(self.qkv_proj, "weight", src)
            if self.qkv_proj.bias is not None:
                set_source_slices(self.qkv_proj, "bias", src)
            set_source_slices(self.o_proj, "weight", {None: rows(heads.q_start * D, q_size, dim=1)})
            if config.o_proj_bias and parallel.rank != 0:
                set_other_rank(self.o_proj, "bias")

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's new K/V into `cache`."""
        T = x.shape[0]
        D = self.head_dim
        H, KVH = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, H + 2 * KVH, D)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H : H + KVH])), dim=1)
        else:
            qk = qkv[:, : H + KVH]
        qk = apply_rotary(qk, *cos_sin)  # q and k rotated together: [T, H + KVH, D]
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH :]
        o = backend.forward(self.layer, q, k, v, cache, self.window)  # [T, H, D]
        return self.parallel.all_reduce(self.o_proj(o.reshape(T, self.num_heads * D)))


def make_mlp(config: ModelConfig, layer: int, parallel: ParallelContext = SINGLE) -> nn.Module:
    """The feed-forward block of a layer: dense, or sparse MoE for MoE configs."""
    if config.moe is not None and layer not in config.moe.dense_layers:
        return SparseMoE(config, parallel)
    return DenseMLP(config.hidden_size, config.intermediate_size, parallel)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer, parallel)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, hidden] each -> (this layer's MLP output, the residual stream before it).

        The residual add is deferred into the next norm (`add_rms_norm`): the layer's output is
        `x + residual` of the returned pair; the first layer gets residual None."""
        if residual is None:
            h, normed = x, self.input_layernorm(x)
        else:
            normed, h = add_rms_norm(self.input_layernorm, x, residual)
        attn = self.self_attn(normed, cos_sin, cache, backend)
        normed, h = add_rms_norm(self.post_attention_layernorm, attn, h)
        return self.mlp(normed), h


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
            if parallel.sharded
            # An explicit weight skips nn.Embedding's random init, whose meta-device kernels alone
            # cost ~170 MB of resident memory the first time they run; the loader fills it.
            else nn.Embedding(
                config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
            )
        )
        # Pipeline parallel: this stage's layers only, at their model-wide indices (names match
        # the checkpoint's); the embedding on the first stage (and the last, when the LM head is
        # tied to it), the final norm on the last. What a stage lacks is an empty buffer.
        mine = parallel.stage_layers(config.num_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, parallel) if i in mine else nn.Module() for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not (parallel.first_stage or (parallel.last_stage and config.tie_word_embeddings)):
            _not_held(self.embed_tokens, "weight")
        if not parallel.last_stage:
            _not_held(self.norm, "weight")


def _not_held(module: nn.Module, name: str) -> None:
    """Another pipeline stage holds `module.<name>`: here an empty buffer of its dtype and device
    (which code asking `norm.weight.device` still finds), neither loaded nor saved."""
    w = getattr(module, name)
    delattr(module, name)
    module.register_buffer(name, w.new_empty(0), persistent=False)


class CausalLM(nn.Module):
    """Parameter names follow transformers' (`model.layers.N...`, `lm_head`) but for the fused
    projections; `checkpoint_name_map` translates checkpoint names to (parameter, shard).

    Built with a sharded `ParallelContext`, every parameter has this rank's local shape and the
    vocabulary is split too: the LM head computes this rank's logit columns, gathered after.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        if parallel.pipelined and config.vision is not None:
            raise ValueError("--pipeline-parallel-size: vision-language models run without pipeline stages")
        self.config = config
        self.parallel = parallel
        self.model = Backbone(config, parallel)
        v_start, v_size = parallel.split(config.vocab_size)
        untied = not config.tie_word_embeddings and parallel.last_stage
        self.lm_head = nn.Linear(config.hidden_size, v_size, bias=False) if untied else None
        if self.lm_head is not None and parallel.sharded:
            set_source_slices(self.lm_head, "weight", {None: rows(v_start, v_size)})
        # The tied LM head as a linear of its own once packed or quantized (`engine/model/linear.py`);
        # until then the embedding table is used directly.
        self.tied_head: nn.Module | None = None
        heads = split_heads(config.num_heads, config.num_kv_heads, parallel)
        self.local_heads, self.local_kv_heads = heads.heads, heads.kv_heads  # the KV cache holds these
        self.stage_layers = parallel.stage_layers(config.num_layers)  # ... of these layers
        self.rope = RotaryEmbedding(config)
        # A vision-language model's image encoder (`engine/model/vision/encoder.py`), set by the loader.
        self.vision: ImageEncoder | None = None

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after building on the meta device)."""
        device = self.model.embed_tokens.weight.device
        self.rope = RotaryEmbedding(self.config).to(device)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on normed hidden states: [N, hidden] -> [N, V_local] float32, summed in
        float32 and never rounded to the model dtype (`engine/model/head.py`)."""
        head = self.lm_head or self.tied_head
        return head_logits(head, self.model.embed_tokens.weight if head is None else None, x)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        """One step.

        Args:
            input_ids: [T] int64, the step's new tokens, sequences concatenated.
            meta: the batch description (positions, pages); `backend` must be planned with it.
            kv_caches: per layer `[num_pages, 2, page_size, KVH, D]`.
            logits_indices: [N] rows of the batch whose logits are wanted (None = all).
            images: image features and M-RoPE positions of the step's rows (vision-language models).
        Returns:
            [N, vocab] float32 logits.
        """
        return self.stage_forward(input_ids, meta, kv_caches, backend, logits_indices, images)

    def stage_forward(
        self,
        inputs: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        """This pipeline stage's part of `forward` (all of it on one stage).

        Args:
            inputs: [T] int64 token ids on the first stage; else [T, hidden] hidden states, the
                previous stage's output.
            kv_caches: this stage's layers' caches, in order.
        Returns:
            [N, vocab] float32 logits on the last stage; else [T, hidden], the residual stream
            after this stage's layers (the next stage's input).
        """
        first = self.parallel.first_stage
        x = merge_embeddings(self.model.embed_tokens(inputs), images) if first else inputs  # [T, hidden]
        cos_sin = rotary(self.rope, meta.positions, images, x.dtype)
        residual: torch.Tensor | None = None
        layers = [self.model.layers[i] for i in self.stage_layers]
        for i, layer, cache in zip(self.stage_layers, layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, cache, backend)
            x = add_deepstack(x, images, i)
        if not self.parallel.last_stage:
            return x if residual is None else x + residual  # what add_rms_norm would sum first
        if logits_indices is not None and residual is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x = self.model.norm(x) if residual is None else add_rms_norm(self.model.norm, x, residual)[0]
        logits = self.head(x)  # [N, V_local] float32
        if self.parallel.sharded:
            logits = gather_vocab(logits, self.config.vocab_size, self.parallel)  # [N, V]
        return logits

    def shard_specs(self) -> dict[str, dict[object, ShardIndex]]:
        """Packed parameters by full name, each with its parts' destinations."""
        out = {}
        for mname, module in self.named_modules():
            for pname, specs in module.__dict__.get("shard_specs", {}).items():
                out[f"{mname}.{pname}" if mname else pname] = specs
        return out

    def source_slices(self) -> dict[str, dict[object, SourceSlice]]:
        """Split parameters by full name: per shard key, the part of the checkpoint tensor to read."""
        out = {}
        for mname, module in self.named_modules():
            for pname, slices in module.__dict__.get("source_slices", {}).items():
                out[f"{mname}.{pname}" if mname else pname] = slices
        return out

    def _held_by_stage(self) -> Callable[[str], bool]:
        """Whether a checkpoint tensor belongs to this pipeline stage (always, on one stage)."""
        if not self.parallel.pipelined:
            return lambda name: True
        mine = self.stage_layers
        embed = self.parallel.first_stage or (self.parallel.last_stage and self.config.tie_word_embeddings)
        last = self.parallel.last_stage

        def held(name: str) -> bool:
            if name.startswith("model.layers."):
                return int(name.split(".")[2]) in mine
            if name.startswith("model.embed_tokens."):
                return embed
            if name.startswith(("model.norm.", "lm_head.")):
                return last
            return True

        return held

    def checkpoint_name_map(self) -> Callable[[str], tuple[str, object] | None]:
        """A function from a checkpoint tensor name to (our parameter name, shard key or None),
        `OTHER_RANK` for a tensor only other ranks load, or None for a tensor this model does not use."""
        packed = {
            "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
            "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
            "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
            "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
            "mlp.up_proj": ("mlp.gate_up_proj", "up"),
        }
        params = dict(self.named_parameters())
        others = {
            f"{mname}.{p}"
            for mname, module in self.named_modules()
            for p in module.__dict__.get("other_rank_params", ())
        }
        moe_maps = {
            name: module.checkpoint_name_map
            for name, module in self.named_modules()
            if hasattr(module, "checkpoint_name_map") and module is not self
        }

        vision = self.config.vision
        held = self._held_by_stage()

        def mapped(name: str) -> tuple[str, object] | None:
            if not held(name):
                return OTHER_RANK
            if vision is not None:  # the decoder's names under `model.`, the encoder's under `vision.`
                name = vision.checkpoint_name(name)
                if name.startswith("vision."):
                    return (name, None) if name in params else None
            for old, new in CHECKPOINT_RENAMES:
                name = name.replace(old, new)
            for prefix, fn in moe_maps.items():
                if name.startswith(prefix + "."):
                    hit = fn(name[len(prefix) + 1 :])
                    if hit == OTHER_RANK:
                        return OTHER_RANK
                    if hit is not None:
                        return prefix + "." + hit[0], hit[1]
            for src, (dst, shard) in packed.items():
                marker = "." + src + "."
                if marker in name:
                    target = name.replace(marker, "." + dst + ".")
                    return (target, shard) if target in params else None
            if name in others:
                return OTHER_RANK
            return (name, None) if name in params else None

        return mapped
