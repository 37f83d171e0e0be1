"""The GGUF conversion cache: a second load reads the cache and gets the same model and tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.loading.gguf_cache import GGUFCache, TeeSource, _umask
from engine.loading.loader import load_tokenizer, open_source
from engine.loading.model_source import resolve_model
from engine.loading.weights import SafetensorsSource, load_model
from tests.test_gguf import tiny_gguf


def _load_twice(path: Path) -> tuple[list[object], list[torch.nn.Module], list[str]]:
    sources, models, prints = [], [], []
    for _ in range(2):
        source = resolve_model(str(path))
        cache = GGUFCache(source.path)
        config, tensors = open_source(source, cache)
        model, stats = load_model(config, tensors, torch.float32, progress=False)
        if isinstance(tensors, TeeSource):
            assert tensors.complete
            cache.save_weights(tensors.kept)
        sources.append(tensors)
        models.append(model)
        prints.append(stats.fingerprint)
    return sources, models, prints


def test_second_load_reads_the_cache_and_matches(tmp_path: Path) -> None:
    path, _ = tiny_gguf(tmp_path, "llama-tied-llama3")
    sources, models, prints = _load_twice(path)
    assert isinstance(sources[0], TeeSource) and isinstance(sources[1], SafetensorsSource)
    assert prints[0] == prints[1], "the cached weights must keep the KV namespace's fingerprint"
    first, second = (dict(m.named_parameters()) for m in models)
    assert first.keys() == second.keys()
    for name, p in first.items():
        assert torch.equal(p, second[name]), name


def test_a_replaced_file_is_converted_again(tmp_path: Path) -> None:
    path, _ = tiny_gguf(tmp_path, "llama-tied-llama3")
    _load_twice(path)
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
    _load_twice(path)
    cache = GGUFCache(path)
    for p in [cache.weights_file, cache.config_file]:  # as a plain write would make them
        assert p.stat().st_mode & 0o777 == 0o666 & ~_umask(), oct(p.stat().st_mode)
    cache.weights_file.write_bytes(b"\xff" * 64)  # a damaged header
    _, tensors = open_source(resolve_model(str(path)), cache)
    assert isinstance(tensors, TeeSource), "a damaged cache must fall back to the GGUF"
