"""Everything needed to run a model, loaded from one `--model` value."""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import cpu_kernel
from engine.distributed.parallel import SINGLE, ParallelContext
from engine.loading.calibrate import Calibration, collect, text_ids
from engine.loading.calibration_cache import CalibrationCache, cache_key
from engine.loading.gguf_cache import GGUFCache, TeeSource
from engine.loading.int4_cache import Int4CodesCache
from engine.loading.model_source import ModelPath, resolve_model
from engine.loading.overrides import apply_overrides, fingerprint
from engine.loading.safetensors_file import CheckpointError
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import LoadStats, SafetensorsSource, TensorCallback, TensorSource, load_model
from engine.model.config import ModelConfig
from engine.model.linear_bf16 import bf16_emulated
from engine.model.model import CausalLM
from engine.model.quant import Int4Blocks, QuantConfig

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
    """bf16 runs faster than float32 on this CPU: AVX512-BF16 or AMX (bf16 matmuls several times
    faster than float32), or AVX-512 and a C++ compiler to build `linear_bf16.cpp` (bf16 weights
    computed in float32: half the bytes per decode step, prefill at float32's speed)."""
    flags = cpu_kernel.cpu_flag_set()
    return bool(flags & {"avx512_bf16", "amx_bf16"}) or (bf16_emulated() and cpu_kernel.compiler() is not None)


def _calibration(
    source: ModelPath,
    config: ModelConfig,
    tensors: TensorSource,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig,
    tokenizer: Tokenizer,
    hf_overrides: dict[str, Any] | None,
    progress: bool | None,
) -> Calibration:
    """int4's calibration statistics: from `$LONGCTX_HOME/calibration` when this model, dtype,
    group and text were calibrated before (`engine.loading.calibration_cache`), else computed
    over the unquantized model (loaded for it, then dropped) and stored there."""
    ids = text_ids(tokenizer)
    cache = CalibrationCache()
    key = cache_key(source, dtype, quant.group_size, ids, hf_overrides)
    found = cache.get(key)
    if found is not None:
        log.info("int4 calibration read from %s (%d tokens)", cache.path(key), found.tokens)
        return found
    float_model, _ = load_model(config, tensors, dtype, device, progress=progress)
    calibration = collect(float_model, ids, quant.group_size)
    del float_model
    cache.put(key, calibration)
    return calibration


def int4_wants_bf16(device: torch.device) -> bool:
    """Whether int4's CPU kernel (`_weight_int4pack_mm_for_cpu`) needs bf16 activations to be
    fast here: below AVX-512 it runs bf16 vectorized but float32 on a slow path (on a 2-core
    AVX2 EPYC, a 1536 x 576 product at one row: 0.15 ms in bf16, 4.2 ms in float32; at 256
    rows 14 ms against 1,082 ms; the demo model int4 decoded 1.4 tok/s and prefilled 4 tok/s in
    float32, 19.9 and 242 in bf16)."""
    if device.type != "cpu" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return "avx512f" not in cpu_kernel.cpu_flag_set()


def resolve_dtype(
    name: str, config: ModelConfig, source: ModelPath, device: torch.device, quantization: str = "none"
) -> torch.dtype:
    """`auto` is the checkpoint's dtype, except that float32 and GGUF weights run in bfloat16
    on CUDA or on a CPU with fast bf16, and int4 runs bf16 activations where its kernel needs
    them (`int4_wants_bf16`)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if quantization == "int4" and int4_wants_bf16(device):
        return torch.bfloat16
    native = DTYPES.get(config.dtype, torch.float32)
    fast_bf16 = device.type == "cuda" or cpu_has_fast_bf16()
    if (source.kind == "gguf" or native == torch.float32) and fast_bf16:
        return torch.bfloat16
    return native if source.kind != "gguf" else torch.float32


def open_source(
    source: ModelPath, cache: GGUFCache | None = None, dtype: torch.dtype | None = None
) -> tuple[ModelConfig, TensorSource]:
    """The config and tensors of `source`. A GGUF's come from its conversion cache when `cache`
    has them (the weights in `dtype` if cached, else in float32); otherwise from the file, its
    tensors kept (`TeeSource`) so that `load` can cache them."""
    if source.kind != "gguf":
        return ModelConfig.from_pretrained_dir(source.path), SafetensorsSource(source.path)
    config = cache.config() if cache is not None else None
    if cache is not None and config is not None:
        want = dtype or torch.float32
        if want != torch.float32 and cache.has_weights(want) and cache.fingerprint() is not None:
            typed = _cached_weights(cache, want)
            if typed is not None:
                return config, typed
        found = _float32_conversion(cache)
        if found is not None:  # kept when loaded in another dtype: to cache them in that one
            return config, found if want == torch.float32 else TeeSource(found)
    from engine.loading.gguf_file import GGUFSource

    gguf = GGUFSource(source.path)
    if cache is None:
        return gguf.config, gguf
    if config is None:
        cache.save_config(gguf.config)
    return gguf.config, TeeSource(gguf)


def converted_for_quantizing(
    cache: GGUFCache | None, config: ModelConfig | None, quant: QuantConfig
) -> tuple[ModelConfig, SafetensorsSource] | None:
    """A quantized load of a GGUF reads the file's float32 conversion when its cache has one
    (`config`: the cache's, as `load` read it): the values dequantizing the file gives, without
    parsing it (the demo model's vocabulary alone takes gguf's reader 2.5 s) or dequantizing it
    again. Not int4 at the GGUF's own group, which takes the file's blocks as they are; never
    written (a quantized load's weights are not the file's)."""
    if cache is None or not quant.enabled or (quant.mode == "int4" and quant.group_size == Int4Blocks.GROUP):
        return None
    found = None if config is None else _float32_conversion(cache)
    return (config, found) if config is not None and found is not None else None


def _float32_conversion(cache: GGUFCache) -> SafetensorsSource | None:
    """The GGUF's weights as dequantized to float32, when its cache holds them (readable)."""
    return _cached_weights(cache, torch.float32) if cache.has_weights() else None


def _cached_weights(cache: GGUFCache, dtype: torch.dtype) -> SafetensorsSource | None:
    try:
        return SafetensorsSource(cache.weights_dir(dtype), mapped=True)
    except (CheckpointError, OSError) as e:  # unreadable or damaged: read the GGUF again
        log.warning("ignoring the conversion cache %s: %s", cache.weights_dir(dtype), e)
        return None


def _cache_weights(cache: GGUFCache, tensors: TensorSource, dtype: torch.dtype, stats: LoadStats) -> None:
    """After a load: record the fingerprint, cache what was converted, or take the recorded
    fingerprint when the weights came from the cache in `dtype` (their digest is of `dtype`)."""
    recorded = cache.fingerprint()
    typed = isinstance(tensors, SafetensorsSource) and tensors.directory == cache.weights_dir(dtype)
    if typed and dtype != torch.float32:
        if recorded is not None:
            stats.fingerprint = recorded
        return
    if recorded is None:  # float32 values were hashed: the GGUF's own fingerprint
        cache.save_fingerprint(stats.fingerprint)
    if isinstance(tensors, TeeSource) and tensors.complete and tensors.kept:
        if not isinstance(tensors.source, SafetensorsSource):  # read from the GGUF itself
            cache.save_weights(tensors.kept)
        if dtype != torch.float32:
            cache.save_weights(tensors.kept, dtype)


def load_tokenizer(source: ModelPath, eos_token_ids: tuple[int, ...], cache: GGUFCache | None) -> Tokenizer:
    """The tokenizer; a GGUF's converted one is saved in, and next time read from, its cache."""
    if cache is not None and cache.has_tokenizer():
        return Tokenizer.from_saved(cache.tokenizer_dir, eos_token_ids)
    tokenizer = Tokenizer.load(source, eos_token_ids)
    if cache is not None:
        cache.save_tokenizer(tokenizer.hf)
    return tokenizer


def load(
    spec: str,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = None,
    parallel: ParallelContext = SINGLE,
    cache: bool = True,
    on_tensor: TensorCallback | None = None,
    quantization: str = "none",
    group_size: int = 32,
    before_tokenizer: Callable[[], object] | None = None,
    calibrate: bool = True,
    hf_overrides: dict[str, Any] | None = None,
    chat_template: str | None = "keep",
) -> LoadedModel:
    """Resolve, read config, load weights and tokenizer. Phases are timed into the stats.

    Args:
        cache: a GGUF's conversions (config, tokenizer, dequantized weights) are read from, or
            written to, a cache beside the file (`engine.loading.gguf_cache`); sharded or
            quantized loads cache only the config and tokenizer. And int4's codes of float
            weights are kept under `$LONGCTX_HOME/int4` (`engine.loading.int4_cache`).
        on_tensor: called with each tensor as it is read (see `load_weights`).
        quantization: none, int8 or int4 (weight-only, every linear; `engine/model/quant.py`),
            applied while the weights stream in; int4 at group 32 takes GGUF Q4_0 / Q4_1
            blocks as they are, other GGUF blocks are dequantized, then quantized again.
        group_size: int4's group (32, 64 or 128).
        before_tokenizer: called (on the loading thread) once the weights are in, before the
            tokenizer loads: `serve` waits there until its own thread has imported transformers
            (importing it from two threads at once fails).
        calibrate: int4 quantizing float weights (any group but a GGUF's own 32) first runs the
            unquantized model over a calibration text and chooses the codes for the least output
            error (`engine/loading/calibrate.py`). That pass holds the whole float model once
            (every rank of a sharded load holds all of it), so peak memory is the float model
            rather than the quantized one; False skips it (plain rounding, 75% top-1 agreement
            instead of 92% on the demo model at group 128).
        hf_overrides: config values merged in before the model is built (`--hf-overrides`;
            `engine.loading.overrides`); they join the fingerprint, never the GGUF's cache.
        chat_template: `--chat-template` (`Tokenizer.use_chat_template`: None = the checkpoint's,
            or ChatML when it has none); "keep": the checkpoint's as it is (no fallback).
    """
    quant = QuantConfig(quantization, group_size)
    dev = torch.device(device)
    t0 = time.perf_counter()
    source = resolve_model(spec)
    gguf_cache = GGUFCache(source.path) if cache and source.kind == "gguf" else None
    # A quantized load's fingerprint carries its quantization: it is never the GGUF's own.
    weights_cache = gguf_cache if not parallel.distributed and not quant.enabled else None
    config = gguf_cache.config() if gguf_cache is not None else None
    # The dtype decides which cached weights to read; it needs the config (cached or not).
    torch_dtype = resolve_dtype(dtype, config, source, dev, quant.mode) if config is not None else None
    converted = None if parallel.distributed else converted_for_quantizing(gguf_cache, config, quant)
    config, tensors = converted if converted is not None else open_source(source, weights_cache, torch_dtype)
    if gguf_cache is not None and weights_cache is None and gguf_cache.config() is None:
        gguf_cache.save_config(config)
    config = apply_overrides(config, hf_overrides or {})  # after the cache took the checkpoint's own
    torch_dtype = resolve_dtype(dtype, config, source, dev, quant.mode)
    t_config = time.perf_counter() - t0
    calibration, tokenizer, t_calibrate = None, None, 0.0
    if calibrate and quant.mode == "int4" and not (source.kind == "gguf" and quant.group_size == Int4Blocks.GROUP):
        t1 = time.perf_counter()
        if before_tokenizer is not None:
            before_tokenizer()
            before_tokenizer = None
        tokenizer = load_tokenizer(source, config.eos_token_ids, gguf_cache)
        calibration = _calibration(source, config, tensors, torch_dtype, dev, quant, tokenizer, hf_overrides, progress)
        t_calibrate = time.perf_counter() - t1
    coder = Int4CodesCache() if cache and quant.mode == "int4" else None
    model, stats = load_model(
        config,
        tensors,
        torch_dtype,
        dev,
        progress=progress,
        parallel=parallel,
        on_tensor=on_tensor,
        quantization=quant,
        calibration=calibration,
        int4_coder=None if coder is None else coder.codes,
    )
    if coder is not None:
        coder.trim()
    if calibration is not None:
        stats.phases["calibrate"] = t_calibrate
    if coder is not None and coder.hits + coder.misses:
        log.info("int4 codes: %d read from %s, %d chosen", coder.hits, coder.root, coder.misses)
    t1 = time.perf_counter()
    if weights_cache is not None:
        _cache_weights(weights_cache, tensors, torch_dtype, stats)
        stats.phases["cache weights"] = time.perf_counter() - t1
        t1 = time.perf_counter()
    if before_tokenizer is not None:
        before_tokenizer()
        t1 = time.perf_counter()
    if tokenizer is None:
        tokenizer = load_tokenizer(source, config.eos_token_ids, gguf_cache)
    if chat_template != "keep":  # after the cache took the tokenizer as it came
        tokenizer.use_chat_template(chat_template, source.name)
    stats.fingerprint = fingerprint(stats.fingerprint, hf_overrides or {})
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
