"""The LM head's float32 logits (`engine/model/head.py`): every product it may take (VDPBF16PS or
widened bf16, int8 tiles: int16 x int8 with AVX512-VNNI or widened, the block-widened
fallbacks) against the float64 product of the same values, with float32 sums kept, never
rounded to bf16 (with VNNI, within the int16 activations' rounding); and the demo model's
France question, whose first token was a bf16 tie."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention import cpu_kernel
from engine.loading.loader import LoadedModel, load
from engine.model import head
from engine.model.head import FloatHead, float32_product, head_logits, quantized_float32
from engine.model.quant import QuantConfig, QuantLinear
from engine.model_runner import Chunk
from engine.verify.paths import runner_for
from kvstore.block_pool import BlockPool
from tests.kernel_bounds import int16_rounding

SHAPES = [(1, 160, 64), (3, 48, 576), (4, 80, 32), (17, 33, 48), (40, 64, 64), (70, 200, 96)]


def _float32_exact(y: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> None:
    """y is float32 and within float32 summation error of the exact product: far inside one bf16
    step (2^-8 relative), so no bf16 rounding happened on the way."""
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool(((y.double() - exact).abs() <= terms * 2e-6).all()), float((y.double() - exact).abs().max())


@pytest.fixture(params=["kernel", "widened", "fallback"])
def product(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The bf16 head's product: the kernel as this CPU builds it (VDPBF16PS with AVX512-BF16),
    the kernel widening bf16 (the emulated-bf16 CPUs' path), or no kernel (block-widened F.linear)."""
    if request.param != "fallback" and cpu_kernel.linear_bf16_f32() is None:
        pytest.skip("no linear_bf16_f32 kernel in this build (needs AVX-512)")
    if request.param == "widened":
        monkeypatch.setattr(head, "FORCE_WIDENED", True)
    if request.param == "fallback":
        monkeypatch.setattr(cpu_kernel, "linear_bf16_f32", lambda: None)
        monkeypatch.setattr(cpu_kernel, "linear_int8_f32", lambda: None)
        monkeypatch.setattr(head, "_BLOCK_ROWS", 37)  # several blocks, one ragged
    return str(request.param)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_bf16_head_keeps_float32_sums(product: str, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k + 16, generator=g).to(torch.bfloat16)[:, :k]  # rows read with a stride
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    y = float32_product(x, w)
    _float32_exact(y, F.linear(x.double(), w.double()), F.linear(x.double().abs(), w.double().abs()))
    assert torch.equal(FloatHead(w)(x), y) and torch.equal(head_logits(FloatHead(w), w, x), y)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int8_head_keeps_float32_sums(product: str, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 100 + n + k)
    w = torch.randn(n, k, generator=g)
    layer = QuantLinear(w.to(torch.bfloat16), None, QuantConfig("int8"), torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q, s = layer.qweight.double(), layer.scales.double()
    y = quantized_float32(layer, x)
    exact, terms = (x.double() @ q.T) * s, (x.double().abs() @ q.abs().T) * s
    if product == "kernel" and cpu_kernel.int8_vnni():  # x's rows as int16: exact integer sums after
        assert y.dtype == torch.float32
        bound = terms * 2e-6 + int16_rounding(x, layer.qweight, layer.scales)
        assert bool(((y.double() - exact).abs() <= bound).all())
    else:
        _float32_exact(y, exact, terms)
    assert torch.equal(head_logits(layer, w, x), y)


def test_float32_heads_and_plain_tables() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 32, generator=g), torch.randn(50, 32, generator=g)
    lin = torch.nn.Linear(32, 50)
    assert head_logits(None, w, x).dtype == torch.float32 and torch.allclose(head_logits(None, w, x), x @ w.T)
    assert torch.allclose(head_logits(lin, w, x), lin(x))
    f32 = QuantLinear(w, None, QuantConfig("int8"), torch.float32)
    assert quantized_float32(f32, x).dtype == torch.float32


@pytest.fixture(scope="module")
def demo_bf16(demo_gguf: Path) -> LoadedModel:
    return load(str(demo_gguf), dtype="bfloat16", progress=False)


def test_france_first_token_is_no_longer_a_tie(demo_bf16: LoadedModel, demo_float32: LoadedModel) -> None:
    """The chat question's first answer token: float32's logits for "The" and "L" are 0.09 apart,
    less than bf16's step at that magnitude (0.125); a bf16-rounded head tied them exactly and argmax
    took "L". With float32 logits the bf16 model keeps them apart and answers "The"."""
    tok = demo_bf16.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    the, l_ = tok.encode("The")[-1], tok.encode("L")[-1]
    for lm in (demo_float32, demo_bf16):
        logits = _last_logits(lm, ids)
        assert logits.dtype == torch.float32 and int(logits.argmax()) == the
        assert logits[the] != logits[l_]
    assert isinstance(demo_bf16.model.tied_head, FloatHead)


def _last_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:

    runner = runner_for(lm.model, False, "kernel")
    pages = BlockPool(runner.kv_cache.num_pages).allocate(-(-len(ids) // 16))
    return runner.run([Chunk(ids, pages, len(ids))])[0]
