"""The compiled step (`engine/model/compiled.py`) equals the eager step, and really is compiled.

The same steps, mixed prefill + decode included, run through two runners over one tiny model:
one eager, one compiled. Compiled graphs are cached in the pytest cache directory (inductor's FX
graph cache, keyed by graph, options and torch version), so only a session with a cold cache
pays for the C++ builds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from engine.attention import cpu_kernel
from engine.loading.model_source import longctx_home
from engine.loading.weights import SafetensorsSource, load_model
from engine.model import linear, quant
from engine.model.compile_setup import compile_available, prepare
from engine.model.compiled import CompiledStep
from engine.model.graph_store import NativeGraph
from engine.model.linear_bf16 import WidenedLinear
from engine.model.quant import QuantConfig
from engine.model.regions import post_attention, pre_attention
from engine.model_runner import Chunk
from kvstore.block_pool import BlockPool
from tests.compile_cache import configure_compile
from tests.server import ROOT
from tests.tiny_models import TinyModel, build_tiny, make_runner

pytestmark = pytest.mark.skipif(compile_available() is not None, reason=f"cannot compile: {compile_available()}")

# One step per entry: per sequence, (first token index, number of tokens). Sequences are fixed
# token lists; a step computes tokens [start, start + n) of each listed sequence.
DENSE_STEPS = [
    {0: (0, 70)},  # 70 tokens: past the largest bucket, eager in both runners
    {0: (70, 1), 1: (0, 15)},  # 16: a decode and a prefill chunk together
    {0: (71, 1), 1: (15, 1), 2: (0, 2)},  # 4: two decodes and a prefill chunk
    {0: (72, 1), 1: (16, 1), 2: (2, 1)},  # 3, padded to 4
    {0: (73, 1)},  # 1
]
DENSE_BUCKETS = {1, 4, 16}
MOE_STEPS = [
    {0: (0, 70)},  # eager
    {0: (70, 1), 1: (0, 1)},  # 2: a decode and a one-token prefill chunk
    {0: (71, 1), 1: (1, 1)},  # 2: two decodes
]


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The graph store: new per session, so that the first run of each model here traces its
    graphs through dynamo (and counts them); inductor's FX cache is kept across sessions."""
    return tmp_path_factory.mktemp("graphs")


@pytest.fixture(scope="module", autouse=True)
def _setup(request: pytest.FixtureRequest, graph_dir: Path) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # dynamo's caches live on code objects: a module run earlier in this process (xdist worker)
    # may have traced the same regions, and this module counts the graphs it traces itself
    torch._dynamo.reset()
    configure_compile(graph_dir)
    prepare()
    yield
    torch.set_num_threads(threads)


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (80,), generator=g).tolist() for _ in range(3)]


class Pair:
    """An eager and a compiled runner over the same model, each with its own KV cache."""

    def __init__(self, tiny: TinyModel, buckets: tuple[int, ...] | None = None):
        self.eager = make_runner(tiny.config, tiny.model)
        self.compiled = make_runner(tiny.config, tiny.model)
        self.step = CompiledStep(tiny.model, buckets)
        self.compiled.step = self.step
        self.seqs = _sequences(tiny.config.vocab_size)

    def run(self, steps: list[dict[int, tuple[int, int]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Both runners through `steps` from empty caches: (eager, compiled) logits of every row."""
        out = []
        runners = (self.eager, self.compiled)
        pools = [BlockPool(r.kv_cache.num_pages) for r in runners]
        tables = [{i: p.allocate(6) for i in range(len(self.seqs))} for p in pools]
        for step in steps:
            logits = []
            for runner, table in zip(runners, tables, strict=True):
                chunks = [Chunk(self.seqs[i][s : s + n], table[i], s + n) for i, (s, n) in step.items()]
                logits.append(runner.run(chunks, all_logits=True))
            out.append((logits[0], logits[1]))
        return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def _compiled_run(tiny: TinyModel, steps: list[dict[int, tuple[int, int]]]) -> dict[str, Any]:
    pair = Pair(tiny)
    graphs = counters["stats"]["unique_graphs"]
    first = pair.run(steps)
    new_graphs = counters["stats"]["unique_graphs"] - graphs
    with torch.compiler.set_stance("fail_on_recompile"):  # the same buckets again: no compile at all
        second = pair.run(steps)
    return {"first": first, "second": second, "graphs": new_graphs, "buckets": pair.step.compiled_buckets}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("compile-dense"))


@pytest.fixture(scope="module")
def dense_run(dense: TinyModel) -> dict[str, Any]:
    return _compiled_run(dense, DENSE_STEPS)


def test_dense_compiled_equals_eager(dense_run: dict[str, Any]) -> None:
    assert dense_run["buckets"] == DENSE_BUCKETS
    for eager, compiled in dense_run["first"] + dense_run["second"]:
        assert eager.shape == compiled.shape
        assert _rel(eager, compiled) <= 1e-5


def test_chosen_buckets_pad_up_to_the_next_chosen_one(dense: TinyModel, dense_run: dict[str, Any]) -> None:
    """`--compile-buckets 4,16`: the one-token step runs padded in bucket 4, the 70-token one
    eager, and every step's logits equal eager's."""
    pair = Pair(dense, (16, 4))
    assert pair.step.buckets == (4, 16)
    for eager, compiled in pair.run(DENSE_STEPS):
        assert _rel(eager, compiled) <= 1e-5
    assert pair.step.compiled_buckets == {4, 16}
    with pytest.raises(ValueError, match="some of 1,2,4,8,16,32,64"):
        CompiledStep(dense.model, (3,))


def test_dense_graphs_counted_without_breaks(dense_run: dict[str, Any]) -> None:
    # Two regions (before and after attention) per bucket, shared by both layers.
    assert dense_run["graphs"] == 2 * len(DENSE_BUCKETS)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_moe_compiled_equals_eager(tmp_path: Path) -> None:
    tiny = build_tiny(MixtralConfig, MixtralForCausalLM, tmp_path, num_local_experts=8, num_experts_per_tok=2)
    run = _compiled_run(tiny, MOE_STEPS)
    assert run["buckets"] == {2}
    assert run["graphs"] == 2  # before attention, and o_proj -> residual -> norm (the experts run eager)
    for eager, compiled in run["first"] + run["second"]:
        assert _rel(eager, compiled) <= 1e-5
    assert not counters["graph_break"]


def test_int4_compiled_equals_eager_and_reloads_from_the_store(dense: TinyModel) -> None:
    """int4 weight-only linears (float32 activations): the compiled step equals the eager one.
    inductor gives their graphs a constant (the group size as a tensor) that its own wrapper
    appends to each call; the direct calls append it too, and so does a second model whose
    layers bind from the graph store (the constant read back from disk)."""
    steps = [{0: (0, 70)}, {0: (70, 1)}, {0: (71, 1)}]
    runs = []
    for _ in range(2):
        model, _ = load_model(
            dense.config, SafetensorsSource(dense.path), torch.float32, progress=False,
            quantization=QuantConfig("int4", 32),
        )  # fmt: skip
        pair = Pair(TinyModel(dense.ref, dense.path, dense.config, model))
        runs.append(pair.run(steps))
        calls = [c for layers in pair.step.bound.values() for layer in layers for c in layer]
        assert set(pair.step.bound) == {1} and all(isinstance(c.fn, NativeGraph) for c in calls)
        assert any(c.fn.constants for c in calls)  # type: ignore[union-attr]
    for (eager, a), (_, b) in zip(*runs, strict=True):
        assert _rel(eager, a) <= 1e-5 and torch.equal(a, b)


def test_widened_bf16_compiled_equals_eager(dense: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 linears computed in float32 (`linear_bf16.py`, the path of CPUs that emulate bf16):
    the kernel's op traced into the regions' graphs, no graph breaks, logits as eager's (bf16
    activations: a compiled graph rounds fewer intermediates than eager's separate ops)."""
    if cpu_kernel.linear_bf16() is None:
        pytest.skip("no linear_bf16 kernel in this build (needs AVX-512)")
    monkeypatch.setattr(linear, "bf16_emulated", lambda: True)
    model, _ = load_model(dense.config, SafetensorsSource(dense.path), torch.bfloat16, progress=False)
    layer: Any = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, WidenedLinear)
    breaks = sum(counters["graph_break"].values())
    run = _compiled_run(TinyModel(dense.ref, dense.path, dense.config, model), DENSE_STEPS)
    assert run["buckets"] == DENSE_BUCKETS and run["graphs"] == 2 * len(DENSE_BUCKETS)
    assert sum(counters["graph_break"].values()) == breaks
    for eager, compiled in run["first"] + run["second"]:
        assert _rel(eager, compiled) <= 2e-2


def test_int8_bf16_compiled_equals_eager(dense: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 with bf16 activations, through the prefill-sized bucket whose products dequantize the
    weight (`DEQUANTIZE_ROWS`), in float32 as where the CPU emulates bf16: traced without a
    break, logits as eager's."""
    monkeypatch.setattr(quant, "BF16_EMULATED", True)
    model, _ = load_model(
        dense.config, SafetensorsSource(dense.path), torch.bfloat16, progress=False, quantization=QuantConfig("int8")
    )
    breaks = sum(counters["graph_break"].values())
    run = _compiled_run(TinyModel(dense.ref, dense.path, dense.config, model), [{0: (0, 60)}, {0: (60, 1)}])
    assert run["buckets"] == {1, 64}
    assert sum(counters["graph_break"].values()) == breaks
    for eager, compiled in run["first"] + run["second"]:
        assert _rel(eager, compiled) <= 2e-2


def _outermost_ops(fn: Callable[[], object]) -> int:
    """Operator calls (aten::, mkldnn::, ...) that `fn` makes and no other operator made."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    n = 0
    for e in prof.events():
        if "::" not in e.name:
            continue
        parent = e.cpu_parent
        while parent is not None and "::" not in parent.name:
            parent = parent.cpu_parent
        n += parent is None
    return n


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The dense tiny model's shapes with 8 layers: the same compiled graphs serve it."""
    return build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("compile-deep"), num_hidden_layers=8)


def test_compiled_decode_runs_under_half_the_ops(deep: TinyModel, dense_run: dict[str, Any]) -> None:
    """The layer regions of a decode step run under half the operator calls of eager, and the
    whole step (with the eager attention, embedding, head and batch description) fewer."""
    pair = Pair(deep)
    step = pair.step
    pool = BlockPool(pair.eager.kv_cache.num_pages)
    pages = pool.allocate(5)
    ids = pair.seqs[0][:71]
    whole = []
    with torch.compiler.set_stance("fail_on_recompile"):  # bucket 1's graphs exist (dense_run)
        for runner in (pair.eager, pair.compiled):
            runner.run([Chunk(ids[:70], pages, 70)])  # eager in both (past the largest bucket)
            whole.append(_outermost_ops(lambda r=runner: r.run([Chunk(ids[70:], pages, 71)])))  # type: ignore[misc]
        # The region calls of one decode step, recorded, then replayed compiled and eager.
        calls: list[tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...]]] = []
        region = step._region

        def record(bucket: int, layer: int, which: int, args: tuple[Any, ...]) -> Any:
            calls.append((step.post, post_attention, args) if which else (step.pre, pre_attention, args))
            return region(bucket, layer, which, args)

        step._region = record  # type: ignore[method-assign]
        step.bound.clear()  # each layer's calls through `_region` (bound to the same graphs)
        step.use_direct = False
        pair.compiled.run([Chunk(ids[70:], pages, 71)])
        assert len(calls) == 2 * deep.config.num_layers

        def replay(compiled: bool) -> None:
            with torch.inference_mode():
                for c, e, args in calls:
                    (c if compiled else e)(*args)

        eager_regions = _outermost_ops(lambda: replay(False))
        compiled_regions = _outermost_ops(lambda: replay(True))
    print(f"outermost operator calls: layer regions {eager_regions} eager, {compiled_regions} compiled; "
          f"whole step {whole[0]} eager, {whole[1]} compiled")  # fmt: skip
    assert compiled_regions < eager_regions / 2, (compiled_regions, eager_regions)
    assert whole[1] < whole[0], whole


def test_compiled_graphs_are_called_without_dynamo(deep: TinyModel, dense_run: dict[str, Any]) -> None:
    """Once a layer's graph is bound (here from the graph store, which `dense_run` filled with
    the same shapes' graphs), a step calls the graphs' C++ entry points directly: no guard
    evaluation, no AOTAutograd or inductor wrapper, and the same logits as the calls through dynamo."""
    pair = Pair(deep)
    steps = DENSE_STEPS[:3]
    with torch.compiler.set_stance("fail_on_recompile"):
        first = pair.run(steps)  # binds every (bucket, layer, region) these steps use
        calls = pair.step.direct.values()
        assert calls and all(call is not None and isinstance(call.fn, NativeGraph) for call in calls)
        assert set(pair.step.bound) == {4, 16}  # whole steps run through the bound graphs
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            second = pair.run(steps)
    names = {e.name for e in prof.events()}
    wrappers = ("Dynamo", "Torch-Compiled Region", "CompiledFxGraph")
    assert not [n for n in names if any(w in n for w in wrappers)], sorted(names)
    for (eager, a), (_, b) in zip(first, second, strict=True):
        assert _rel(eager, a) <= 1e-5 and torch.equal(a, b)


STORED_START = """
import json, sys
from pathlib import Path
import torch
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.compile_setup import configure
from engine.model.compiled import CompiledStep
from engine.model.config import ModelConfig
from engine.model.graph_store import NativeGraph
from engine.model.quant import QuantConfig
from engine.model_runner import Chunk, build_kernels
from kvstore.block_pool import BlockPool
from tests.tiny_models import make_runner

torch.set_num_threads(1)
home, graphs, model_dir = map(Path, sys.argv[1:])
build_kernels(torch.device("cpu"))  # as an engine does before binding (the store's key names them)
configure(home, graphs)
config = ModelConfig.from_pretrained_dir(model_dir)
model, _ = load_model(config, SafetensorsSource(model_dir), torch.float32, progress=False)
eager, compiled = make_runner(config, model), make_runner(config, model)
compiled.step = step = CompiledStep(model)
step.warm_up(16, buckets=(1, 4, 16))  # all stored: nothing run, the layers bind at first use
warmed = sorted(step.bound)
ids = torch.randint(0, config.vocab_size, (21,), generator=torch.Generator().manual_seed(1)).tolist()
logits = []
for runner in (eager, compiled):
    pages = BlockPool(runner.kv_cache.num_pages).allocate(2)
    steps = [(0, 16), (16, 20), (20, 21)]  # buckets 16, 4 and 1
    logits.append(torch.cat([runner.run([Chunk(ids[a:b], pages, b)], all_logits=True) for a, b in steps]))
native = all(isinstance(c.fn, NativeGraph) for layers in step.bound.values() for pair in layers for c in pair)
print(json.dumps({
    "modules": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules),
    "warmed": warmed, "bound": sorted(step.bound), "native": native,
    "error": float((logits[0] - logits[1]).abs().max() / logits[0].abs().max()),
}))
"""


def test_start_with_stored_graphs_imports_neither_dynamo_nor_inductor(
    dense: TinyModel, dense_run: dict[str, Any], graph_dir: Path, tmp_path: Path
) -> None:
    """A new process whose graphs are all in the store (`dense_run` put buckets 1, 4 and 16
    there) runs no warm-up step and binds every layer from the store at its bucket's first
    step: dynamo and inductor are never imported, and the compiled step still equals the
    eager one."""
    proc = subprocess.run(
        [sys.executable, "-c", STORED_START, str(tmp_path), str(graph_dir), str(dense.path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["modules"] == [], result
    assert result["warmed"] == [] and result["bound"] == [1, 4, 16] and result["native"], result
    assert result["error"] <= 1e-5, result


def test_compile_flags() -> None:
    from api.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--no-compile"])).compile is False
    assert engine_config(p.parse_args(["--device", "cpu"])).compile is True  # a compiler is here (see skipif)
    assert engine_config(p.parse_args(["--device", "cpu", "--compile"])).compile is True
    # sharded ranks compile their shards (tests/test_serve_sharded.py, tests/test_parallel.py)
    assert engine_config(p.parse_args(["--device", "cpu", "--tensor-parallel-size", "2"])).compile is True
    assert engine_config(p.parse_args(["--device", "cpu", "--pipeline-parallel-size", "2"])).compile is True
    assert engine_config(p.parse_args(["--device", "cuda"])).compile is False
    with pytest.raises(ValueError, match="--compile"):
        engine_config(p.parse_args(["--device", "cuda", "--compile"]))
    assert torch._dynamo.config.fail_on_recompile_limit_hit  # past the limit: an error, never eager
    assert engine_config(p.parse_args([])).compile_buckets is None  # all
    assert engine_config(p.parse_args(["--compile-buckets", "64,1"])).compile_buckets == (1, 64)
    for bad in ("1,3", "1,,2", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--compile-buckets", bad])


def test_eager_by_default_with_hooks_seeing_every_layer(dense: TinyModel) -> None:
    """`EngineConfig()` (the doctor's, the test engines') runs eager: forward hooks see every module."""
    from engine.engine import Engine, EngineConfig
    from engine.sampling_params import SamplingParams

    engine = Engine(dense.model, None, EngineConfig(kv_cache_bytes=1 << 22, attention_backend="torch_paged"))
    assert engine.runner.step is dense.model
    seen: list[str] = []
    names = {m: n for n, m in dense.model.named_modules()}
    hooks = [
        m.register_forward_hook(lambda mod, args, out: seen.append(names[mod]))
        for n, m in dense.model.named_modules()
        if n.endswith(("mlp", "input_layernorm", "o_proj"))
    ]
    try:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.run_until_idle()
    finally:
        for h in hooks:
            h.remove()
    assert {"model.layers.1.mlp", "model.layers.0.input_layernorm", "model.layers.1.self_attn.o_proj"} <= set(seen)


def test_packed_weights_reach_the_graphs_as_packed(dense: TinyModel) -> None:
    """oneDNN's prepacked bf16 weights (opaque mkldnn tensors, fake strides (1, 0)) enter the
    compiled graphs as the very tensors the modules packed: every `_linear_pointwise` a compiled
    step makes, through the bound C++ graphs, gets one of the model's packed weights itself, not
    a copy (a copy made by an inductor pass would follow the fake strides and read garbage)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not linear.packing_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 packing on this CPU")
    model, _ = load_model(dense.config, SafetensorsSource(dense.path), torch.bfloat16, progress=False)
    packed = {m.weight._cdata for m in model.modules() if isinstance(m, linear.PackedLinear)}
    assert len(packed) == 4 * dense.config.num_layers  # qkv, o_proj, gate_up, down
    pair = Pair(TinyModel(dense.ref, dense.path, dense.config, model))
    steps = DENSE_STEPS[1:3]
    pair.run(steps)  # compiles (or loads) and binds buckets 16 and 4

    class Weights(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[bool, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.mkldnn._linear_pointwise.default:
                self.seen.append((args[1].is_mkldnn, args[1]._cdata))
            return func(*args, **(kwargs or {}))

    with Weights() as mode:
        out = pair.run(steps)
    assert set(pair.step.bound) >= {4, 16}
    assert mode.seen and all(is_mkldnn and ptr in packed for is_mkldnn, ptr in mode.seen), mode.seen[:4]
    assert len(mode.seen) >= 2 * 4 * dense.config.num_layers  # eager and compiled runners, 4 linears a layer
    for eager, compiled in out:
        assert _rel(eager, compiled) <= 2e-2


CPP_KEY = """
import sys
from pathlib import Path
import torch
import torch._inductor.codecache as codecache
from engine.model.compile_setup import configure, prepare
configure(Path(sys.argv[1]), Path(sys.argv[2]))
prepare()
keyed = codecache.write
keys = []
def spy(content, extension, extra="", *args, **kwargs):
    out = keyed(content, extension, extra, *args, **kwargs)
    if extension == "main.cpp":
        keys.append(out[0])
    return out
codecache.write = spy
torch.set_num_threads(1)
torch.compile(lambda x: (x * 2).sin() + 1)(torch.randn(8))
print(torch.__file__, *keys)
"""


def test_graph_cpp_builds_are_found_from_another_environment(tmp_path: Path) -> None:
    """inductor keys a graph's C++ build by its compile command, which names torch's headers by
    their path in the environment: the same graph compiled with torch imported from elsewhere (a
    new clone's `.venv`; here a link to the same package) gets the same key, so its build is found
    in the shared cache rather than built again."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "torch").symlink_to(Path(torch.__file__).parent)
    home = longctx_home()  # the tests' one inductor cache (`tests/compile_cache.py`)
    out = []
    for torch_dir in (None, elsewhere):  # `-c` puts the working directory (the checkout) first
        env = {**os.environ, "PYTHONPATH": str(torch_dir)} if torch_dir else None
        cmd = [sys.executable, "-c", CPP_KEY, str(home), str(tmp_path / "graphs")]
        run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
        out.append(run.stdout.split())
    (here, *keys_here), (there, *keys_there) = out
    assert there.startswith(str(elsewhere)) and not here.startswith(str(elsewhere))  # two torch paths
    assert keys_here and keys_here == keys_there
