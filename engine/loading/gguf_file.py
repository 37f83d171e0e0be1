"""GGUF files (llama.cpp's format) as a `TensorSource`: metadata to `ModelConfig`, tensors to float32.

The model and the loader speak transformers' names and layouts, so this module translates
once, here: GGUF tensor names become transformers parameter names, quantized blocks are
dequantized with the `gguf` package, and the Q/K row permutation that llama.cpp's converter
applies to llama checkpoints (it rotates interleaved pairs, we rotate halves) is undone.
The reader memory-maps the file; only the tensor being read is dequantized in memory.

A truncated or corrupt file is a `CheckpointError` naming the file, raised when the source
is opened rather than deep inside numpy while the model is being filled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from engine.loading.safetensors_file import CheckpointError
from engine.loading.weights import SourceTensor
from engine.model.config import ModelConfig, RopeConfig, UnsupportedModel
from engine.model.quant import Int4Blocks

# GGUF `general.architecture` -> transformers architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Per-layer GGUF tensor stems -> transformers module paths under `model.layers.N.`.
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^(\w+)\.(weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors for Llama 3 RoPE scaling

# The Llama 3.x family's RoPE parameters besides `factor` (llama.cpp stores only the result).
_LLAMA3_CANDIDATES = ((1.0, 4.0, 8192),)

# What a damaged file makes GGUFReader (numpy on a memory map) raise.
_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError, UnicodeDecodeError)
_MISSING = object()


class GGUFSource:
    """One `.gguf` file: `config` from its metadata, `tensors()` under transformers' names."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.description = str(self.path)
        try:
            self.reader = GGUFReader(self.path)
        except _READ_ERRORS as e:
            raise CheckpointError(f"{self.path}: unreadable or truncated GGUF file ({type(e).__name__}: {e})") from e
        self._check_layout()
        self.arch = self._str("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModel(
                f"{self.path}: unsupported GGUF architecture {self.arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.by_name = {t.name: t for t in self.reader.tensors}
        try:
            self.config = self._build_config()
        except UnsupportedModel as e:
            if str(self.path) in str(e):
                raise
            raise UnsupportedModel(f"{self.path}: {e}") from e
        self._check_quant_types()

    # --- validation -------------------------------------------------------------------------

    def _check_layout(self) -> None:
        """Every tensor must lie inside the file: the reader slices a memory map, which silently
        comes back short for a truncated file instead of failing."""
        if self.reader.byte_order != "I":
            raise UnsupportedModel(f"{self.path}: big-endian GGUF files are not supported")
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise CheckpointError(
                    f"{self.path}: truncated or corrupt GGUF file: tensor {t.name!r} needs bytes "
                    f"{t.data_offset}..{t.data_offset + t.n_bytes}, the file has {size}"
                )
        splits = self._value("split.count", 1)
        if isinstance(splits, int) and splits > 1:
            raise UnsupportedModel(
                f"{self.path}: split GGUF files ({splits} parts) are not supported; merge them with "
                "`llama-gguf-split --merge` first"
            )

    def _check_quant_types(self) -> None:
        """Fail before building the model if a tensor's quantization cannot be dequantized:
        try one row of each type present."""
        seen: set[GGMLQuantizationType] = set()
        for t in self.reader.tensors:
            if t.tensor_type in seen:
                continue
            seen.add(t.tensor_type)
            row = t.data.reshape(-1, t.data.shape[-1])[:1] if t.data.ndim else t.data
            try:
                dequantize(row, t.tensor_type)
            except NotImplementedError as e:
                raise UnsupportedModel(
                    f"{self.path}: tensor {t.name!r} has GGML type {t.tensor_type.name}, which cannot be dequantized"
                ) from e

    # --- metadata ---------------------------------------------------------------------------

    def _value(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        try:
            return field.contents()
        except _READ_ERRORS as e:
            raise CheckpointError(f"{self.path}: corrupt GGUF metadata value for {key!r}: {e}") from e

    def _str(self, key: str, default: Any = _MISSING) -> Any:
        value = self._value(key, default)
        if value is not default and not isinstance(value, str):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} should be a string, got {value!r}")
        return value

    def _int(self, key: str, default: Any = _MISSING) -> Any:
        """An integer, or a per-layer list of equal integers (which some converters write)."""
        value = self._value(key, default)
        if value is default:
            return value
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise UnsupportedModel(f"{self.path}: per-layer values of {key!r} are not supported: {value}")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} should be an integer, got {value!r}")
        return value

    def _float(self, key: str, default: Any = _MISSING) -> Any:
        value = self._value(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} should be a number, got {value!r}")
        return float(value)

    def _build_config(self) -> ModelConfig:
        a = self.arch
        hidden = self._int(f"{a}.embedding_length")
        num_heads = self._int(f"{a}.attention.head_count")
        num_kv_heads = self._int(f"{a}.attention.head_count_kv", num_heads)
        # Older llama files carry no key_length; their rope.dimension_count is the head size
        # (all three architectures rotate the whole head), as transformers also assumes.
        rope_dim = self._int(f"{a}.rope.dimension_count", None)
        head_dim = self._int(f"{a}.attention.key_length", None) or rope_dim or hidden // num_heads
        rope_dim = rope_dim or head_dim
        value_dim = self._int(f"{a}.attention.value_length", head_dim)
        if value_dim != head_dim:
            raise UnsupportedModel(f"{self.path}: key_length {head_dim} != value_length {value_dim}")
        if rope_dim != head_dim:
            raise UnsupportedModel(f"{self.path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
        embd = self.by_name.get("token_embd.weight")
        if embd is not None:
            vocab_size = int(embd.shape[1])  # GGUF lists dimensions innermost first: [hidden, vocab]
        else:
            tokens = self._value("tokenizer.ggml.tokens", None)
            vocab_size = self._int(f"{a}.vocab_size", len(tokens) if tokens else _MISSING)
        # llama.cpp ends generation at any of these (Llama 3 instruct files mark <|eot_id|> as eot).
        eos = [self._int(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[a],
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=self._int(f"{a}.feed_forward_length"),
            num_layers=self._int(f"{a}.block_count"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=self._float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            max_position_embeddings=self._int(f"{a}.context_length", 4096),
            rope=self._rope(head_dim),
            tie_word_embeddings="output.weight" not in self.by_name,
            attention_bias=a == "qwen2" or any(n.endswith(".attn_q.bias") for n in self.by_name),
            o_proj_bias=any(n.endswith(".attn_output.bias") for n in self.by_name),
            qk_norm=a == "qwen3",
            dtype="float32",
            bos_token_id=self._int("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        )

    def _rope(self, head_dim: int) -> RopeConfig:
        a = self.arch
        theta = self._float(f"{a}.rope.freq_base", 10000.0)
        kind = self._str(f"{a}.rope.scaling.type", "none")
        factor = self._float(f"{a}.rope.scaling.factor", None)
        if kind == "none" and self._float(f"{a}.rope.scale_linear", 1.0) != 1.0:  # the key before scaling.type
            kind, factor = "linear", self._float(f"{a}.rope.scale_linear")
        if ROPE_FREQS in self.by_name:
            if kind != "none":
                raise UnsupportedModel(f"{self.path}: both {ROPE_FREQS} and rope scaling type {kind!r}")
            return self._llama3_rope(theta, head_dim)
        if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
            return RopeConfig(theta=theta)
        if kind == "linear":
            return RopeConfig(theta=theta, type="linear", factor=factor)
        if kind == "yarn":
            ext = self._float(f"{a}.rope.scaling.yarn_ext_factor", 1.0)
            if ext >= 0 and ext != 1.0:  # llama.cpp: negative means "derive", which gives 1 for YaRN
                raise UnsupportedModel(f"{self.path}: YaRN extrapolation factor {ext} is not supported")
            if self._float(f"{a}.rope.scaling.yarn_log_multiplier", 0.0):
                raise UnsupportedModel(f"{self.path}: YaRN log multiplier (DeepSeek mscale) is not supported")
            return RopeConfig(
                theta=theta,
                type="yarn",
                factor=factor or 1.0,
                original_max_position_embeddings=self._int(f"{a}.rope.scaling.original_context_length", None),
                beta_fast=self._float(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
                beta_slow=self._float(f"{a}.rope.scaling.yarn_beta_slow", 1.0),
                attention_factor=self._float(f"{a}.rope.scaling.yarn_attn_factor", None),
            )
        raise UnsupportedModel(f"{self.path}: unsupported RoPE scaling type {kind!r}; supported: none, linear, yarn")

    def _llama3_rope(self, theta: float, head_dim: int) -> RopeConfig:
        """llama.cpp stores Llama 3 RoPE scaling as a tensor of per-frequency divisors, not as
        parameters: find the standard parameters that reproduce it, or refuse the file."""
        t = self.by_name[ROPE_FREQS]
        divisors = self._dequantize(t).reshape(-1).astype(np.float64)
        if divisors.size != head_dim // 2:
            raise CheckpointError(f"{self.path}: {ROPE_FREQS} has {divisors.size} values, expected {head_dim // 2}")
        if np.allclose(divisors, 1.0):
            return RopeConfig(theta=theta)
        factor = float(divisors.max())
        for low, high, orig in _LLAMA3_CANDIDATES:
            if np.allclose(llama3_rope_divisors(theta, head_dim, factor, low, high, orig), divisors, rtol=1e-4):
                return RopeConfig(
                    theta=theta,
                    type="llama3",
                    factor=factor,
                    low_freq_factor=low,
                    high_freq_factor=high,
                    original_max_position_embeddings=orig,
                )
        raise UnsupportedModel(f"{self.path}: {ROPE_FREQS} does not match Llama 3 RoPE scaling with factor {factor}")

    # --- tensors ----------------------------------------------------------------------------

    def tensors(self) -> Iterator[SourceTensor]:
        for t in self.reader.tensors:
            if t.name == ROPE_FREQS:
                continue  # folded into config.rope
            name, permute_heads = self._hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            int4 = partial(self._read_int4, t, shape, permute_heads) if _int4_type(t, shape) else None
            yield SourceTensor(
                name,
                shape,
                int(t.n_bytes),
                str(self.path),
                partial(self._read, t, shape, permute_heads),
                read_int4=int4,
            )

    def _hf_name(self, name: str) -> tuple[str, int | None]:
        """Transformers' name for a GGUF tensor, and the head count to un-permute its rows by
        (llama's Q and K), if any. Unknown names pass through so that the loader reports them."""
        m = _LAYER_NAME.match(name)
        if m and m.group(2) in LAYER_TENSORS:
            layer, stem, kind = m.groups()
            heads = None
            if self.arch == "llama" and stem in ("attn_q", "attn_k"):
                heads = self.config.num_heads if stem == "attn_q" else self.config.num_kv_heads
            return f"model.layers.{layer}.{LAYER_TENSORS[stem]}.{kind}", heads
        m = _GLOBAL_NAME.match(name)
        if m and m.group(1) in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}", None
        return name, None

    def _dequantize(self, t: ReaderTensor) -> np.ndarray:
        try:
            out = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModel(f"{self.path}: cannot dequantize {t.name!r} ({t.tensor_type.name})") from e
        return np.asarray(out, dtype=np.float32)

    def _read(self, t: ReaderTensor, shape: tuple[int, ...], permute_heads: int | None) -> torch.Tensor:
        arr = self._dequantize(t)
        if not arr.flags.writeable:  # F32 comes back as a view of the read-only memory map
            arr = arr.copy()
        out = torch.from_numpy(arr).reshape(shape)
        return unpermute_qk(out, permute_heads) if permute_heads else out

    def _read_int4(self, t: ReaderTensor, shape: tuple[int, ...], permute_heads: int | None) -> Int4Blocks:
        """A Q4_0 / Q4_1 matrix's blocks as they are: codes [N, K] and per 32 a scale and zero.
        Each block is a float16 scale d (Q4_1: then a float16 min m) and 16 bytes holding the
        block's 32 codes, elements 0-15 in the low nibbles, 16-31 in the high ones; the value is
        d (q - 8) (Q4_0) or d q + m (Q4_1)."""
        N, K = shape
        head = 2 if t.tensor_type == GGMLQuantizationType.Q4_0 else 4
        b = np.asarray(t.data).reshape(N, K // 32, head + 16)
        d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        if head == 4:
            zero = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) + 8 * d
        else:
            zero = torch.zeros_like(d)
        qs = torch.from_numpy(b[..., head:].copy())  # [N, K/32, 16]
        codes = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(N, K)
        if permute_heads:
            codes, d, zero = (unpermute_qk(x, permute_heads) for x in (codes, d, zero))
        return Int4Blocks(codes, d, zero)


def _int4_type(t: ReaderTensor, shape: tuple[int, ...]) -> bool:
    return t.tensor_type in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1) and len(shape) == 2


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of Q/K rows (weights or biases).

    llama.cpp rotates adjacent pairs (GPT-J style); its converter reorders each head's rows
    from [first half, second half] to interleaved pairs so that its kernel gives the same
    result as transformers' rotate-half. Reordering them back restores transformers' layout.
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def llama3_rope_divisors(
    theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, orig_context: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as `rope_freqs` for Llama 3 scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen > orig_context / low_freq_factor, factor, medium)
    return np.where(wavelen < orig_context / high_freq_factor, 1.0, out)
