"""bf16 linears computed in float32 (`engine/model/linear_bf16.py`, `linear_bf16.cpp`), the
path for CPUs that emulate bf16: the kernel (and its int8 form) against a float64 product of
the same values, and whole tiny models (dense, MoE) built with it against transformers in
float32. The models force the path (`bf16_emulated`) so that it is tested on every AVX-512 CPU."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from engine.attention import cpu_kernel
from engine.loading.weights import SafetensorsSource, load_model
from engine.model import linear
from engine.model.head import FloatHead
from engine.model.linear_bf16 import KERNEL_ROWS, WidenedLinear, widened_matmul
from kvstore.block_pool import BlockPool
from tests.kernel_bounds import int16_rounding
from tests.tiny_models import build_tiny, make_runner, reference_logits, rel_error, run_chunked


def _close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """y (bf16) is the float64 product of the same bf16 values, rounded once: within half a bf16
    step (at most 2^-8 relative) plus float32 summation error (a few 1e-7 of the sum of |terms|)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    terms = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    bound = exact.abs() * 2.0**-8 + terms * 1e-6
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert bool(((y.double() - exact).abs() <= bound).all())


def _cases(n: int) -> list[tuple[int, int, int, bool]]:
    rng = random.Random(7)
    fixed = [(0, 32, 16, False), (1, 1728, 576, True), (4, 576, 1536, False), (16, 160, 64, True), (33, 40, 48, True)]
    return fixed + [
        (rng.randint(1, KERNEL_ROWS + 8), rng.randint(1, 80), 16 * rng.randint(1, 12), rng.random() < 0.5)
        for _ in range(n)
    ]


@pytest.mark.parametrize(("m", "n", "k", "bias"), _cases(20))
def test_kernel_equals_the_exact_product_rounded(m: int, n: int, k: int, bias: bool) -> None:
    """Every tile shape (1 x 16, 2 x 8, 4 x 4, their mixes), N's tail past a multiple of 16, rows
    read with a stride, with and without bias; and `widened_matmul` past KERNEL_ROWS (oneDNN in
    float32)."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k + 16, generator=g).to(torch.bfloat16)[:, :k]  # rows strided by k + 16
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    op = cpu_kernel.linear_bf16()
    if op is None:  # the kernels are built by conftest's session fixture
        pytest.skip("no linear_bf16 kernel in this build (needs AVX-512)")
    _close_to_exact(op(x, w, b), x, w, b)
    _close_to_exact(widened_matmul(x, w, b), x, w, b)


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "_"), [*_cases(10), (2, 20, 4160, False), (5, 17, 8208, False)])
def test_int8_kernel_equals_the_exact_product_rounded(m: int, n: int, k: int, _: bool, widen: bool) -> None:
    """The int8 kernel (per-row scales; the path of int8 linears with bf16 activations where the
    CPU has AVX512-VNNI or emulates bf16) on the same tile shapes, against the exact scaled
    product: with VNNI x's rows quantized to int16 (within `int16_rounding`, then exact integer
    sums, converted to float32 every 4,096 columns: K past that, twice), else (`widen`) float32
    sums of the widened values."""
    op = cpu_kernel.linear_int8()
    if op is None:
        pytest.skip("no linear_int8 kernel in this build (needs AVX-512)")
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k + 16, generator=g).to(torch.bfloat16)[:, :k]
    x[:, 0] *= 40  # an outlier column: the other values' int16 steps are coarser
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.02).to(torch.bfloat16)
    y = op(x, q, scales, widen)
    exact = (x.double() @ q.double().T) * scales.double()
    terms = (x.double().abs() @ q.double().abs().T) * scales.double()
    bound = exact.abs() * 2.0**-8 + terms * 1e-6
    if cpu_kernel.int8_vnni() and not widen:
        bound = bound + int16_rounding(x, q, scales)
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("widen", [False, True])
def test_int8_kernel_keeps_nan_and_infinity_visible(widen: bool) -> None:
    """A row of x holding NaN or infinity gives non-finite products (with VNNI its int16 codes
    would otherwise be finite), and the other rows are untouched."""
    op = cpu_kernel.linear_int8()
    if op is None:
        pytest.skip("no linear_int8 kernel in this build (needs AVX-512)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    x[1, 5], x[2, 60] = float("nan"), float("inf")
    q = torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8)
    scales = torch.full((40,), 0.01, dtype=torch.bfloat16)
    y = op(x, q, scales, widen)
    assert not bool(y[1].isfinite().any()) and not bool(y[2].isfinite().any())
    assert bool(y[0].isfinite().all()) and bool(y[3].isfinite().all())
    assert torch.equal(y[[0, 3]], op(x[[0, 3]], q, scales, widen))


@pytest.fixture
def widened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models loaded in bf16 get `WidenedLinear`s whatever this CPU's bf16 support."""
    monkeypatch.setattr(linear, "bf16_emulated", lambda: True)


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "kwargs"),
    [(LlamaConfig, LlamaForCausalLM, {}), (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4})],
)
def test_widened_models_close_to_float32(
    widened: None, tmp_path: Path, config_cls: type, model_cls: type, kwargs: dict[str, Any]
) -> None:
    t = build_tiny(config_cls, model_cls, tmp_path, **kwargs)
    model, _ = load_model(t.config, SafetensorsSource(t.path), torch.bfloat16, progress=False)
    layers = [m for m in model.modules() if isinstance(m, WidenedLinear)]
    # q/k/v, o, gate/up, down per dense layer (experts: two per expert); the head keeps float32 logits
    assert len(layers) >= 3 * t.config.num_layers and isinstance(model.tied_head or model.lm_head, FloatHead)
    ids = torch.randint(0, t.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = make_runner(t.config, model)
    out = run_chunked(runner, BlockPool(runner.kv_cache.num_pages), ids, 8)  # decode-sized and prefill chunks
    assert rel_error(out, reference_logits(t.ref, ids)) < 3e-2
