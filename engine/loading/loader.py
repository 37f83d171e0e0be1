"""Everything needed to run a model, loaded from one `--model` value."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.distributed.parallel import SINGLE, ParallelContext
from engine.loading.model_source import ModelPath, resolve_model
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import LoadStats, SafetensorsSource, TensorSource, load_model
from engine.model.config import ModelConfig
from engine.model.model import CausalLM
from engine.model.quant import QuantConfig

log = logging.getLogger("longctx.loader")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    source: ModelPath
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    stats: LoadStats


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run several times faster than float32 on such CPUs."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, config: ModelConfig, source: ModelPath, device: torch.device) -> torch.dtype:
    """`auto` is the checkpoint's dtype, except that float32 and GGUF weights run in bfloat16
    on CUDA or on a CPU with fast bf16."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    native = DTYPES.get(config.dtype, torch.float32)
    fast_bf16 = device.type == "cuda" or cpu_has_fast_bf16()
    if (source.kind == "gguf" or native == torch.float32) and fast_bf16:
        return torch.bfloat16
    return native if source.kind != "gguf" else torch.float32


def open_source(source: ModelPath) -> tuple[ModelConfig, TensorSource]:
    if source.kind == "gguf":
        from engine.loading.gguf_file import GGUFSource

        gguf = GGUFSource(source.path)
        return gguf.config, gguf
    return ModelConfig.from_pretrained_dir(source.path), SafetensorsSource(source.path)


def load(
    spec: str,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = None,
    parallel: ParallelContext = SINGLE,
    quantization: str = "none",
    group_size: int = 32,
) -> LoadedModel:
    """Resolve, read config, load weights and tokenizer. Phases are timed into the stats.

    quantization: none, int8 or int4 (weight-only, every linear; `engine/model/quant.py`),
    applied while the weights stream in; GGUF blocks are dequantized first, then requantized.
    group_size: int4's group (32, 64 or 128)."""
    quant = QuantConfig(quantization, group_size)
    dev = torch.device(device)
    t0 = time.perf_counter()
    source = resolve_model(spec)
    config, tensors = open_source(source)
    torch_dtype = resolve_dtype(dtype, config, source, dev)
    t_config = time.perf_counter() - t0
    model, stats = load_model(
        config, tensors, torch_dtype, dev, progress=progress, parallel=parallel, quantization=quant
    )
    t1 = time.perf_counter()
    tokenizer = Tokenizer.load(source, config.eos_token_ids)
    stats.phases = {"resolve+config": t_config, **stats.phases, "tokenizer": time.perf_counter() - t1}
    log.info(
        "model %s (%s, %s%s) ready: %s",
        source.name,
        config.architecture,
        str(torch_dtype).replace("torch.", ""),
        f", {quant.tag}" if quant.enabled else "",
        stats.summary(),
    )
    return LoadedModel(source, config, model, tokenizer, torch_dtype, stats)
