"""Full attention at 32k tokens: a tiny random Llama finds 28,672 tokens of K/V in its cache
(random, written straight into scattered pages: running the model over them would only cost
time), prefills the last 4,096 of a 32,768-token prompt against that long cached prefix, then
decodes one token. For every
layer, the attention output of the last position equals a float64 softmax over the same K/V
read back from the cache, within 1e-5 (float32) and 2e-2 (bf16), relative to the output's
largest entry; the logits stay finite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.attention.torch_paged import TorchPagedBackend
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.config import ModelConfig
from engine.model_runner import Chunk, ModelRunner
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec
from tests.tiny_models import build_tiny, one_thread, rel_error

CONTEXT, CHUNK, PAGE = 32_768, 4096, 16


class RecordingBackend(TorchPagedBackend):
    """Keeps each layer's query and attention output of the step's last token."""

    def forward(self, layer, q, k, v, cache, window=None):  # type: ignore[no-untyped-def]
        out = super().forward(layer, q, k, v, cache, window)
        self.last[layer] = (q[-1].double(), out[-1].double())
        return out

    def plan(self, meta):  # type: ignore[no-untyped-def]
        super().plan(meta)
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D]; keys, values [L, KVH, D] float64 -> [H, D]: one query over all L keys."""
    G = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(G, dim=1)  # [L, H, D]
    v = values.repeat_interleave(G, dim=1)
    weights = (torch.einsum("hd,lhd->hl", q, k) * scale).softmax(dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_thread()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Path]:
    tiny = build_tiny(
        LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("llama32k"), max_position_embeddings=CONTEXT + 64
    )
    return tiny.config, tiny.path


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_last_position_matches_float64_at_32k(
    tiny_llama: tuple[ModelConfig, Path], dtype: torch.dtype, tol: float
) -> None:
    config, path = tiny_llama
    model, _ = load_model(config, SafetensorsSource(path), dtype, progress=False)
    spec = KVSpec(config.num_layers, config.num_kv_heads, config.head_dim, PAGE, str(dtype).replace("torch.", ""))
    num_pages = CONTEXT // PAGE + 2
    backend = RecordingBackend(config.num_heads, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, KVCache(spec, num_pages), backend)
    table = torch.randperm(num_pages).tolist()  # pages scattered over the pool
    ids = torch.randint(0, config.vocab_size, (CONTEXT + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    gen = torch.Generator().manual_seed(4)
    prefix_pages = torch.tensor(table[: (CONTEXT - CHUNK) // PAGE])
    for cache in runner.kv_cache.layers:  # [P, 2, S, KVH, D]
        shape = (len(prefix_pages), *cache.shape[1:])
        cache[prefix_pages] = (2 * torch.randn(shape, generator=gen)).to(dtype)
    logits = runner.run([Chunk(ids[CONTEXT - CHUNK : CONTEXT], table, CONTEXT)])
    assert torch.isfinite(logits).all()
    check_last(runner, backend, table, CONTEXT, tol)  # the last prefill chunk's last row
    logits = runner.run([Chunk(ids[CONTEXT:], table, CONTEXT + 1)])  # one decode step
    assert torch.isfinite(logits).all()
    check_last(runner, backend, table, CONTEXT + 1, tol)


def check_last(runner: ModelRunner, backend: RecordingBackend, table: list[int], kv_len: int, tol: float) -> None:
    pages = torch.tensor(table[: -(-kv_len // PAGE)])
    assert sorted(backend.last) == list(range(len(runner.kv_cache.layers)))
    for layer, cache in enumerate(runner.kv_cache.layers):
        q, out = backend.last[layer]
        kv = cache[pages].double()  # [p, 2, S, KVH, D]
        keys = kv[:, 0].reshape(-1, *kv.shape[-2:])[:kv_len]
        values = kv[:, 1].reshape(-1, *kv.shape[-2:])[:kv_len]
        want = reference(q, keys, values, backend.scale)
        assert torch.isfinite(out).all()
        err = rel_error(out, want)
        assert err <= tol, f"layer {layer}, {kv_len} keys: relative error {err:.2e} > {tol}"


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("length", [1024, 3001, 20_000])
def test_split_decode_equals_a_float64_reference(dtype: torch.dtype, tol: float, length: int) -> None:
    """One decoding sequence's keys split into parts merged by log-sum-exp (`split_decode`, used
    from `SPLIT_FROM` keys on) equals unsplit attention in float64, a tail of L % parts included."""
    from engine.attention.long_prefill import SPLIT_FROM, has_lse_attention, split_decode

    if not has_lse_attention(torch.device("cpu")):
        pytest.skip("no CPU flash kernel with log-sum-exp")
    assert length >= SPLIT_FROM
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, 6, 32, generator=g).to(dtype)
    k = torch.randn(1, 2, length, 32, generator=g).to(dtype)
    v = torch.randn(1, 2, length, 32, generator=g).to(dtype)
    got = split_decode(q, k, v, 32**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().reshape(1, 2, 3, 32), k.double(), v.double(), scale=32**-0.5
    ).reshape(1, 6, 32)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert got.dtype == dtype and err < tol, err
