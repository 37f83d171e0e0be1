"""The GGUF conversion cache: a second load reads the cache and gets the same model and tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.loading.gguf_cache import GGUFCache, TeeSource, _umask
from engine.loading.loader import _cache_weights, converted_for_quantizing, load_tokenizer, open_source
from engine.loading.model_source import resolve_model
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.quant import QuantConfig
from tests.test_gguf import tiny_gguf


def _load(path: Path, dtype: torch.dtype) -> tuple[object, torch.nn.Module, str]:
    """What `load` does with the weights (the tiny GGUF has no tokenizer for `load` itself)."""
    source = resolve_model(str(path))
    cache = GGUFCache(source.path)
    config, tensors = open_source(source, cache, dtype)
    model, stats = load_model(config, tensors, dtype, progress=False)
    _cache_weights(cache, tensors, dtype, stats)
    return tensors, model, stats.fingerprint


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    first, second = dict(a.named_parameters()), dict(b.named_parameters())
    assert first.keys() == second.keys()
    for name, p0 in first.items():
        p, q = p0.data, second[name].data
        if p.is_mkldnn:  # bf16 linears prepacked for oneDNN
            p, q = p.to_dense(), q.to_dense()
        assert torch.equal(p, q), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_load_reads_the_cache_and_matches(tmp_path: Path, dtype: torch.dtype) -> None:
    path, _ = tiny_gguf(tmp_path, "llama-tied-llama3")
    first, model1, print1 = _load(path, dtype)
    second, model2, print2 = _load(path, dtype)
    cache = GGUFCache(path)
    assert isinstance(first, TeeSource) and isinstance(second, SafetensorsSource)
    assert second.directory == cache.weights_dir(dtype)
    assert print1 == print2 == cache.fingerprint(), "the cache must keep the KV namespace's fingerprint"
    _same_parameters(model1, model2)


def test_a_float32_cache_is_converted_once_to_the_dtype_loaded(tmp_path: Path) -> None:
    path, _ = tiny_gguf(tmp_path, "llama-tied-llama3")
    _, _, print32 = _load(path, torch.float32)
    cache = GGUFCache(path)
    assert cache.has_weights() and not cache.has_weights(torch.bfloat16)
    first, model1, print1 = _load(path, torch.bfloat16)  # from the float32 cache, kept
    assert isinstance(first, TeeSource) and cache.has_weights(torch.bfloat16)
    second, model2, print2 = _load(path, torch.bfloat16)
    assert isinstance(second, SafetensorsSource) and second.directory == cache.weights_dir(torch.bfloat16)
    assert print32 == print1 == print2
    _same_parameters(model1, model2)


@pytest.mark.parametrize(("mode", "group"), [("int8", 32), ("int4", 64)])
def test_a_quantized_load_reads_the_float32_conversion(tmp_path: Path, mode: str, group: int) -> None:
    """int8, and int4 at another group than the GGUF's own, quantize the file's float32
    conversion when it is cached (not the file: parsing the demo model's takes seconds): the
    same quantized weights and fingerprint as from the file. int4 at group 32 takes the file's
    blocks, so it reads the file; without a conversion there is nothing to read."""
    path, _ = tiny_gguf(tmp_path, "llama-tied-llama3")
    source, quant = resolve_model(str(path)), QuantConfig(mode, group)
    cache = GGUFCache(source.path)
    assert converted_for_quantizing(cache, cache.config(), quant) is None  # nothing converted yet
    _load(path, torch.float32)
    converted = converted_for_quantizing(cache, cache.config(), quant)
    assert converted is not None and isinstance(converted[1], SafetensorsSource)
    assert converted[1].directory == cache.weights_dir(torch.float32)
    assert converted_for_quantizing(cache, converted[0], QuantConfig("int4", 32)) is None
    assert converted_for_quantizing(cache, converted[0], QuantConfig("none")) is None
    config, from_file = open_source(source, None)
    model1, stats1 = load_model(config, from_file, torch.float32, progress=False, quantization=quant)
    model2, stats2 = load_model(converted[0], converted[1], torch.float32, progress=False, quantization=quant)
    assert stats1.fingerprint == stats2.fingerprint
    state1, state2 = model1.state_dict(), model2.state_dict()
    assert state1.keys() == state2.keys() and any(t.dtype in (torch.int8, torch.uint8) for t in state1.values())
    for name, t in state1.items():
        assert torch.equal(t, state2[name]), name


def test_a_replaced_file_is_converted_again(tmp_path: Path) -> None:
    path, _ = tiny_gguf(tmp_path, "llama-tied-llama3")
    _load(path, torch.float32)
    old = GGUFCache(path).dir
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    cache = GGUFCache(path)
    assert cache.dir != old and cache.config() is None and not cache.has_weights()
    _, tensors = open_source(resolve_model(str(path)), cache)
    assert isinstance(tensors, TeeSource)


@pytest.mark.slow
def test_cached_tokenizer_matches_the_converted_one(demo_gguf: Path, tmp_path: Path) -> None:
    gguf = tmp_path / demo_gguf.name
    shutil.copy(demo_gguf, gguf)
    source = resolve_model(str(gguf))
    cache = GGUFCache(gguf)
    converted = load_tokenizer(source, (2,), cache)  # converts from the GGUF, then saves
    assert cache.has_tokenizer()
    cached = load_tokenizer(source, (2,), cache)
    text = "Héllo <|im_start|> wörld\n\n  code: `x = 1`  "
    assert cached.encode(text) == converted.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert cached.apply_chat_template(messages) == converted.apply_chat_template(messages)
    assert cached.decode(cached.encode(text)) == converted.decode(converted.encode(text))
    assert cached.eos_token_ids == converted.eos_token_ids and cached.chat_template == converted.chat_template


def test_cache_is_readable_by_others_and_a_damaged_one_is_ignored(tmp_path: Path) -> None:
    path, _ = tiny_gguf(tmp_path, "llama-tied-llama3")
    _load(path, torch.float32)
    cache = GGUFCache(path)
    for p in [cache.weights_dir() / "model.safetensors", cache.config_file]:  # as a plain write would make them
        assert p.stat().st_mode & 0o777 == 0o666 & ~_umask(), oct(p.stat().st_mode)
    (cache.weights_dir() / "model.safetensors").write_bytes(b"\xff" * 64)  # a damaged header
    _, tensors = open_source(resolve_model(str(path)), cache)
    assert isinstance(tensors, TeeSource), "a damaged cache must fall back to the GGUF"
