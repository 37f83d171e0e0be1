"""Every path a start can choose, against eager float32 (`engine/verify/paths.py`).

dtype {float32, bfloat16} x step {eager, compiled} x quantization {none, int8, int4} x linears
{native (this CPU's pick), widened (the emulated-bf16 CPUs' kernels, forced)} x attention {the C++
kernels, bf16 prefill chunks as one masked SDPA over gathered keys (AMX CPUs' pick for large
chunks, forced for every chunk), SDPA (decode split from 128 keys)}, on a tiny Llama; and a tiny Mistral with a sliding
window (the blocked attention of windowed prefill chunks). Each cell runs the fixed schedule
(prefill and decode buckets, chunks after a cached prefix, mixed and padded steps; teacher forced)
and is held to two bounds, written here:

- against eager float32: top-1 agreement where float32 decides for the cell's dtype
  (`agreement.decided`), and the relative logit error;
- compiled against eager in the same dtype, quantization and kernels, per step bucket (tight).

The compiled graphs are shared with `tests/test_compile.py` (same shapes, same buckets) through
dynamo's cache within the session and inductor's FX cache across sessions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from engine.loading.weights import SafetensorsSource, load_model
from engine.model.compile_setup import compile_available, prepare
from engine.model.head import FloatHead
from engine.model.linear import make_linear
from engine.model.linear_bf16 import WidenedLinear
from engine.model.model import CausalLM
from engine.model.quant import NONE, QuantConfig, QuantLinear
from engine.verify.agreement import Agreement, rel_error
from engine.verify.bounds import compiled_bound
from engine.verify.paths import (
    ATTENTIONS,
    LINEARS,
    TOKENS_A,
    TOKENS_B,
    ScheduleRun,
    ServingPath,
    compare,
    forced,
    reference,
    run_schedule,
)
from tests.compile_cache import configure_compile
from tests.tiny_models import TinyModel, build_tiny

# Floors of top-1 agreement (where float32 decides) and ceilings of the relative logit error,
# against eager float32, per (dtype, quantization); measured on these tiny models: float32 100% /
# 3e-7, bf16 100% / 6e-3, int8 98-99% / 1e-2, int4 90-93% / 9e-2. A broken kernel agrees at
# chance (~1%) and moves logits by >= 10%.
AGREEMENT = {"none": 0.99, "int8": 0.95, "int4": 0.85}
ERROR = {("float32", "none"): 1e-5, ("bfloat16", "none"): 2e-2, ("float32", "int8"): 3e-2}
ERROR_DEFAULT = {"int8": 3e-2, "int4": 0.15}
# Compiled against eager in the same dtype, per bucket.
COMPILED_F32, COMPILED_BF16 = 1e-5, 2e-2

PATHS = [
    ServingPath(dtype, compiled, quantization, lin, attention)
    for dtype, compiled, quantization, lin, attention in itertools.product(
        ("float32", "bfloat16"), (False, True), ("none", "int8", "int4"), LINEARS, ATTENTIONS
    )
    if not (dtype == "float32" and lin == "widened")  # widening is of bf16 weights
    # gathered prefill attention is bf16's, and independent of the linears
    and not (attention == "gathered" and (dtype == "float32" or lin == "widened"))
]


@pytest.fixture(scope="module", autouse=True)
def _setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if compile_available() is not None:
        pytest.skip(f"cannot compile: {compile_available()}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    configure_compile(tmp_path_factory.mktemp("graphs"))
    prepare()
    yield
    torch.set_num_threads(threads)


def _sequences(vocab: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (TOKENS_A,), generator=g).tolist(), torch.randint(
        0, vocab, (TOKENS_B,), generator=g
    ).tolist()


class Cells:
    """The runs of one tiny model, each path run once and kept (compiled cells compare with eager ones)."""

    def __init__(self, tiny: TinyModel):
        self.tiny = tiny
        self.a, self.b = _sequences(tiny.config.vocab_size)
        self.ref = reference(tiny.model, self.a, self.b)
        self.runs: dict[ServingPath, ScheduleRun] = {}

    def load(self, path: ServingPath) -> CausalLM:
        q = QuantConfig(path.quantization, 32)
        model, _ = load_model(
            self.tiny.config, SafetensorsSource(self.tiny.path), path.torch_dtype, progress=False, quantization=q
        )
        return model

    def run(self, path: ServingPath) -> ScheduleRun:
        if path not in self.runs:
            with forced(path):
                model = self.load(path)
                _assert_kernels(model, path)
                self.runs[path] = run_schedule(model, path, self.a, self.b)
        return self.runs[path]

    def agreement(self, path: ServingPath) -> Agreement:
        return compare(self.run(path), self.ref, path.torch_dtype)


def _assert_kernels(model: CausalLM, path: ServingPath) -> None:
    """The forcing took: the linears and the head are of the kinds the path names."""
    layer: Any = model.model.layers[0]
    mlp = layer.mlp.down_proj
    head = model.tied_head or model.lm_head
    if path.quantization != "none":
        assert isinstance(mlp, QuantLinear) and isinstance(head, QuantLinear) and head.mode == "int8"
    elif path.dtype == "bfloat16":
        assert type(mlp) is _bf16_linear_kind(path), type(mlp)
        assert isinstance(head, FloatHead)


def _bf16_linear_kind(path: ServingPath) -> type[torch.nn.Module]:
    """The module a bf16 linear loads as on this path: `widened` is forced; `native` is what the
    dispatcher (`make_linear`) picks on this CPU, where None keeps torch's own `nn.Linear` (an
    AVX2 CPU, where oneDNN neither packs nor emulates bf16)."""
    if path.linear == "widened":
        return WidenedLinear
    picked = make_linear(torch.zeros(16, 16, dtype=torch.bfloat16), None, NONE)
    return torch.nn.Linear if picked is None else type(picked)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Cells:
    return Cells(build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("paths-llama")))


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Cells:
    """A sliding window shorter than the text: windowed decode, and windowed prefill chunks after
    a cached prefix (SDPA: masked in blocks, `attend_blocked`)."""
    return Cells(
        build_tiny(MistralConfig, MistralForCausalLM, tmp_path_factory.mktemp("paths-mistral"), sliding_window=40)
    )


def _check_against_float32(cells: Cells, path: ServingPath) -> Agreement:
    ag = cells.agreement(path)
    floor = AGREEMENT[path.quantization]
    ceiling = ERROR.get((path.dtype, path.quantization), ERROR_DEFAULT.get(path.quantization, 2e-2))
    assert ag.finite and ag.error <= ceiling, f"{path.name}: {ag.describe()} (error bound {ceiling:.0e})"
    assert ag.decided >= floor, f"{path.name}: {ag.describe()} (agreement floor {floor:.0%})"
    assert ag.decided_positions >= 0.9 * ag.positions, ag  # the reference decides almost everywhere
    return ag


def _check_compiled_against_eager(cells: Cells, path: ServingPath) -> None:
    compiled = cells.run(path)
    eager = cells.run(ServingPath(path.dtype, False, *_rest(path)))
    assert compiled.buckets == {1, 4, 16}, compiled.buckets
    bound = COMPILED_F32 if path.dtype == "float32" else COMPILED_BF16
    assert bound <= compiled_bound(path.torch_dtype)  # the start-up self-check's bound is looser
    for bucket, rows in compiled.by_bucket().items():
        err = rel_error(compiled.logits[rows], eager.logits[rows])
        assert err <= bound, f"{path.name} bucket {bucket}: compiled vs eager {err:.2e} > {bound:.0e}"
    # Compiling costs (next to) no agreement: float32 exactly none; bf16 graphs round other
    # intermediates than eager's ops, which moves positions whose float32 margin is a few bf16
    # steps (1%: 3 of ~300); quantized logits sit further from float32's (1.5%).
    c, e = cells.agreement(path), cells.agreement(ServingPath(path.dtype, False, *_rest(path)))
    slack = 0.0 if path.dtype == "float32" else 0.01 if path.quantization == "none" else 0.015
    assert c.decided >= e.decided - slack, (c.describe(), e.describe())


def _rest(path: ServingPath) -> tuple[str, str, str]:
    return path.quantization, path.linear, path.attention


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_path_agrees_with_eager_float32(llama: Cells, path: ServingPath) -> None:
    _check_against_float32(llama, path)
    if path.compiled:
        _check_compiled_against_eager(llama, path)


WINDOWED = [
    ServingPath(dtype, compiled, "none", "native", attention)
    for dtype, compiled, attention in itertools.product(("float32", "bfloat16"), (False, True), ATTENTIONS)
    if not (attention == "gathered" and dtype == "float32")
]


@pytest.mark.parametrize("path", WINDOWED, ids=lambda p: p.name)
def test_windowed_path_agrees_with_eager_float32(windowed: Cells, path: ServingPath) -> None:
    _check_against_float32(windowed, path)
    if path.compiled:
        _check_compiled_against_eager(windowed, path)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_the_default_path_is_in_the_matrix(llama: Cells, quantization: str) -> None:
    """What `--dtype auto` and `--compile` pick on this CPU for each `--quantization` (bf16
    where it is fast, and for int4 where its kernel needs bf16 activations; compiled; the
    kernels) is one of the cells above, not only its neighbours."""
    from engine.loading.loader import cpu_has_fast_bf16, int4_wants_bf16, resolve_dtype
    from engine.loading.model_source import ModelPath
    from engine.model.config import ModelConfig

    cpu = torch.device("cpu")
    source = ModelPath("safetensors", llama.tiny.path, "tiny")
    dtype = resolve_dtype("auto", ModelConfig.from_pretrained_dir(llama.tiny.path), source, cpu, quantization)
    bf16 = cpu_has_fast_bf16() or (quantization == "int4" and int4_wants_bf16(cpu))
    assert dtype == (torch.bfloat16 if bf16 else torch.float32)
    default = ServingPath(str(dtype).removeprefix("torch."), True, quantization, "native", "kernel")
    assert default in PATHS
