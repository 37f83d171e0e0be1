"""Engine throughput on the demo model, side by side with transformers and llama.cpp.

Each (system, dtype) runs in its own subprocess so its peak RSS is its own. Measures:
single-stream decode tokens/s after a short prompt and after a 2k-token prompt, prefill
tokens/s at 512 and 2048 prompt tokens, aggregate decode tokens/s at 1/4/16/32 concurrent
streams, peak RSS; plus the machine's copy bandwidth and each decode figure as a share of its
ceiling (bytes of weights and KV read per step over that bandwidth). For ours (bf16, int8,
int4 = bf16 activations with weight-only int8/int4 linears) also the matmul-only floor: the
step's linears called back to back on one token, and step time / floor; `--profile` splits one
single-stream decode step into matmuls, attention, other ops and Python. llama.cpp runs through
its own generation loop (`create_completion(stream=True)`, EOS suppressed by `logit_bias`),
and is skipped with a note when llama-cpp-python is not installed (`make bench-peers`).
Beside each row of ours, what that configuration generates: teacher-forced top-1 agreement with
eager float32 over a fixed text (`engine/verify/paths.py`); a row under its floor is INVALID and
counts toward no ratio or target.
Ours runs as served: the compiled step (`--compile`, the default where a C++ compiler is
present; its graphs compiled before timing, cached under `$LONGCTX_HOME/compile`) or eager
(`--no-compile`). Single-stream decode is also timed after 256, 4k and 8k-token prompts
(ours), with what the step reads after 8k against after 256 tokens (bytes: weights plus every
layer's K/V) and the rate its extra K/V came in at, beside the machine's plain read rate: a
step bound by memory takes as long as its bytes need. Prints a table, ratios and each target's
verdict, and writes JSON to bench/results/.

    python bench/engine_throughput.py [--quick] [--systems ours,transformers,llama.cpp]
        [--dtypes float32,bfloat16,int8,int4] [--profile] [--no-compile]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
PREFILL_LENGTHS = (512, 2048)
STREAMS = (1, 4, 16, 32)
# Threads per system (`--threads`; 2 = the targets' setting). On a machine shared with other
# work, 2 spinning OpenMP threads can run a step 10-20x slower than 1: use 1 there.
THREADS = int(os.environ.get("LONGCTX_BENCH_THREADS", "2"))
COMPILE = os.environ.get("LONGCTX_BENCH_COMPILE", "1") == "1"
# Single-stream decode after prompts of these lengths (ours): the decode-vs-context targets.
# 8k is the demo model's context less the decoded tokens.
CONTEXTS = {"decode_1_256": 256, "decode_1_2k": 2048, "decode_1_4k": 4096, "decode_1_8k": 8192 - 129}


def copy_bandwidth_gbs() -> float:
    """Bytes read + written per second copying 1 GiB (median of 5)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _median_s(lambda: dst.copy_(src)) / 1e9


def read_bandwidth_gbs() -> float:
    """Bytes read per second by a vectorized reduction over 1 GiB (median of 5): what a step
    bound by memory reads its weights and K/V at, at best."""
    import torch

    torch.set_num_threads(THREADS)
    src = torch.empty(1 << 30, dtype=torch.uint8).fill_(1)
    return src.numel() / _median_s(src.max) / 1e9


def _median_s(fn: Any, reps: int = 5) -> float:
    """Seconds `fn()` takes, the median of `reps` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def _prompt(tok: Any, n: int) -> list[int]:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(n))
    return tok.encode(text)[:n]


def _rss_mb() -> float:
    """Peak RSS of this process (VmHWM: unlike ru_maxrss it does not inherit the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- ours


QUANTIZED = {"int8": "int8", "int4": "int4"}  # dtype column value -> --quantization (bf16 activations)


# Single-stream decode is timed this many times (the median is kept): one 128-token run moves
# by 10-20% with the machine's other work.
SINGLE_STREAM_REPEATS = 5  # rounds over the single-stream lengths (a VM here drifts ~10%)
PREFILL_REPEATS = 3  # ours and transformers alike, the median kept


def run_ours(dtype: str, quick: bool, profile: bool = False) -> dict[str, Any]:
    import torch

    from engine.engine import Engine, EngineConfig
    from engine.loading.loader import load
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(THREADS)
    quant = QUANTIZED.get(dtype, "none")
    loaded = load(
        "smollm2-135m-instruct", dtype="bfloat16" if quant != "none" else dtype, progress=False, quantization=quant
    )
    tok = loaded.tokenizer
    compiled = COMPILE and dtype != "float32"  # float32 is the reference dtype: eager
    if compiled:
        from engine.model.compile_setup import compile_available

        compiled = compile_available() is None
    config = EngineConfig(kv_cache_bytes=512 << 20, max_num_batched_tokens=512, compile=compiled)
    engine = Engine(loaded.model, tok, config)
    out: dict[str, Any] = {"load_s": loaded.stats.seconds, "compiled": compiled}
    if compiled:
        out["compile_s"] = engine.runner.step.warm_up(config.page_size)  # type: ignore[attr-defined]
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(_prompt(tok, 16), greedy)  # warm-up
    engine.run_until_idle()
    for n in PREFILL_LENGTHS:
        rates = []
        for r in range(PREFILL_REPEATS):
            ids = _prompt(tok, n)
            ids[0] = 1000 + r  # a prompt of its own each time: nothing from the prefix cache
            t0 = time.perf_counter()
            engine.add_request(ids, greedy)
            engine.run_until_idle()
            rates.append(len(ids) / (time.perf_counter() - t0))
        out[f"prefill_{n}"] = sorted(rates)[len(rates) // 2]
    decode_tokens = 32 if quick else 128
    params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    for streams in STREAMS[1:] if not quick else (16,):
        prompts = [_prompt(tok, 24 + i) for i in range(streams)]
        out[f"decode_{streams}"], out[f"step_ms_{streams}"] = _decode_rounds(engine, [prompts], params)[0]
    # Single-stream decode after 24 tokens and after long prompts (the prompt's prefill is not
    # timed; repeats find it in the prefix cache), in rounds that visit every length in turn,
    # the median per length kept: the context ratios compare neighbouring runs, not runs
    # minutes apart on a machine whose speed drifts.
    singles = {"decode_1": 24, **CONTEXTS} if not quick else {"decode_1": 24, "decode_1_2k": 2048}
    # The matmul floor is timed in the same rounds (after each), so that step / floor compares
    # neighbouring measurements too.
    floors: list[float] = []
    runs = _decode_rounds(
        engine, [[_prompt(tok, n)] for n in singles.values()], params, SINGLE_STREAM_REPEATS,
        after_round=lambda: floors.append(_matmul_floor_ms(loaded.model)),
    )  # fmt: skip
    for (key, _), (rate, step_ms) in zip(singles.items(), runs, strict=True):
        out[key], out[key.replace("decode", "step_ms")] = rate, step_ms
    out["floor_ms"] = sorted(floors)[len(floors) // 2]
    out.update(_head_cost_ms(loaded.model))
    out["weight_bytes"] = _weight_bytes_per_step(loaded.model)
    out["kv_bytes_per_token"] = engine.kv_spec.bytes_per_token
    out["decode_tokens"] = decode_tokens
    if profile:
        out["profile"] = _profile_step(engine, tok)
    out["peak_rss_mb"] = _rss_mb()
    out["agreement"] = _agreement(loaded, quant, compiled)
    return out


def _agreement(loaded: Any, quant: str, compiled: bool) -> dict[str, Any]:
    """What this configuration generates against eager float32: teacher-forced top-1 agreement over
    the fixed text (`engine/verify/paths.py`), where float32 decides, and whether it is over its
    floor (`engine/verify/bounds.py`): a row under it is INVALID and counts toward no target."""
    from engine.loading.loader import load
    from engine.verify.agreement import TEXT, TEXT_B
    from engine.verify.bounds import agreement_floor
    from engine.verify.paths import TOKENS_A, TOKENS_B, ServingPath, compare, reference, run_schedule

    tok = loaded.tokenizer
    a, b = tok.encode(TEXT)[:TOKENS_A], tok.encode(TEXT_B)[:TOKENS_B]
    ref = reference(load("smollm2-135m-instruct", dtype="float32", progress=False).model, a, b)
    dtype = str(loaded.dtype).replace("torch.", "")
    path = ServingPath(dtype, compiled, quant, "native", "kernel")
    ag = compare(run_schedule(loaded.model, path, a, b), ref, loaded.dtype)
    floor = agreement_floor(loaded.dtype, quant)
    return {"path": path.name, **ag._asdict(), "floor": floor, "valid": ag.finite and ag.decided >= floor}


def _decode_rounds(
    engine: Any, batches: list[list[list[int]]], params: Any, repeats: int = 1, after_round: Any = None
) -> list[tuple[float, float]]:
    """Per batch of prompts, decode `params.max_tokens` tokens for all of them at once; `repeats`
    rounds over the batches in turn (`after_round` called after each). Per batch the median
    run's (tokens/s, ms per step). Prompts are computed before timing starts."""
    runs: list[list[tuple[float, float]]] = [[] for _ in batches]
    for _ in range(repeats):
        for i, prompts in enumerate(batches):
            handles = [engine.add_request(p, params) for p in prompts]
            _prefill(engine)
            steps0, gen0, t0 = engine.stats.steps, engine.stats.generated_tokens, time.perf_counter()
            engine.run_until_idle()
            dt = time.perf_counter() - t0
            for h in handles:
                list(h)
            runs[i].append(
                ((engine.stats.generated_tokens - gen0) / dt, 1000 * dt / max(1, engine.stats.steps - steps0))
            )
        if after_round is not None:
            after_round()
    return [sorted(r)[len(r) // 2] for r in runs]


def _prefill(engine: Any) -> None:
    """Step until every request added has its whole prompt computed (and its first token), so
    that what is timed next is decoding only. The first step drains the engine's inbox: before
    it, requests just added are in no scheduler list (a check-first loop once timed the prompts'
    prefill as decode)."""
    s = engine.scheduler
    engine.step()
    while s.waiting or s.loading or any(r.num_computed < len(r.prompt_ids) for r in s.running):
        engine.step()


def _step_linears(model: Any) -> list[Any]:
    """The linears one single-token step of a dense model runs, in order (LM head last)."""
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers += [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
    head = model.lm_head or model.tied_head
    if head is None:  # float32 tied: the embedding table through F.linear
        import torch.nn.functional as F

        w = model.model.embed_tokens.weight
        return [*layers, lambda x: F.linear(x, w)]
    return [*layers, head]


def _matmul_floor_ms(model: Any, reps: int = 20) -> float:
    """The same linears as one single-token step, called back to back (median ms)."""
    import torch

    dtype = model.model.norm.weight.dtype
    linears = _step_linears(model)
    xs: dict[int, Any] = {}
    for lin in linears:
        k = lin.in_features if hasattr(lin, "in_features") else model.config.hidden_size
        xs.setdefault(k, torch.randn(1, k, dtype=dtype))
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for lin in linears:
                lin(xs[lin.in_features if hasattr(lin, "in_features") else model.config.hidden_size])
            times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[reps // 2]


def _head_cost_ms(model: Any, reps: int = 20) -> dict[str, float]:
    """The LM head at 1 and 16 rows (median ms): as served (float32 logits, `engine/model/head.py`)
    and, for a bf16 model, the prepacked oneDNN product rounded to bf16 that it replaced."""
    import torch

    from engine.model.linear import PackedLinear, packing_supported

    out: dict[str, float] = {}
    dtype = model.model.norm.weight.dtype
    packed = None
    table = getattr(model.model.embed_tokens, "weight", None)  # None: a quantized table (int8 / int4 head)
    bf16_table = isinstance(table, torch.Tensor) and model.lm_head is None
    if dtype == torch.bfloat16 and bf16_table and packing_supported(dtype, torch.device("cpu")):
        assert table is not None
        packed = PackedLinear(table.detach())
    with torch.inference_mode():
        for rows in (1, 16):
            x = torch.randn(rows, model.config.hidden_size, dtype=dtype)
            out[f"head_ms_{rows}"] = 1000 * _median_s(lambda x=x: model.head(x), reps)
            if packed is not None:
                out[f"head_bf16_ms_{rows}"] = 1000 * _median_s(lambda x=x: packed(x).float(), reps)
    return out


MATMUL_OPS = (
    "mkldnn::_linear_pointwise",
    "aten::_weight_int8pack_mm",
    "longctx::linear_bf16",
    "longctx::linear_int8",
    "longctx::linear_bf16_f32",
    "longctx::linear_int8_f32",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::mm",
    "aten::addmm",
)
ATTENTION_OPS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::index_select",
    "aten::index_copy_",
    "longctx::paged_decode",
    "longctx::store_kv",
)


GRAPH_EVENTS = ("CompiledFxGraph", "compiled graph")


def _label_graphs(engine: Any) -> Any:
    """Give each compiled graph the step calls through its C++ entry point a profiler label
    ("compiled graph"; the kernels inside are not ATen ops, so the profiler would otherwise
    count them as Python). Returns a function that removes the labels."""
    import torch

    calls = [c for c in getattr(engine.runner.step, "direct", {}).values() if c is not None and c.entry is not None]
    originals = [(c, c.entry) for c in calls]
    for call, entry in originals:

        def labelled(handles: Any, entry: Any = entry) -> Any:
            with torch.profiler.record_function("compiled graph"):
                return entry(handles)

        call.entry = labelled

    def restore() -> None:
        for c, e in originals:
            c.entry = e

    return restore


def _profile_step(engine: Any, tok: Any, steps: int = 8) -> dict[str, float]:
    """ms per single-stream decode step in matmuls, attention (KV write, page reads, SDPA),
    other ATen ops, and Python (wall time not inside any ATen op); ops per step."""
    import torch

    from engine.sampling_params import SamplingParams

    h = engine.add_request(_prompt(tok, 24), SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    restore = _label_graphs(engine)
    try:
        with torch.profiler.profile() as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - t0
    finally:
        restore()
    engine.run_until_idle()
    list(h)
    events = prof.key_averages()
    top = [e for e in prof.events() if e.cpu_parent is None]  # outermost ops: no double counting
    total = sum(e.cpu_time_total for e in top) / 1000

    def self_ms(names: tuple[str, ...]) -> float:
        return sum(e.cpu_time_total for e in top if e.name in names) / 1000

    matmul = self_ms(MATMUL_OPS) + sum(e.cpu_time_total for e in top if e.name == "aten::linear") / 1000
    attention = self_ms(ATTENTION_OPS) + self_ms(("aten::scaled_dot_product_attention",))
    # The compiled regions' graphs (their matmuls run inside, invisible to the profiler).
    compiled = sum(e.cpu_time_total for e in top if e.name in GRAPH_EVENTS or "Compiled Region" in e.name) / 1000
    return {
        "step_ms": 1000 * wall / steps,
        "matmul_ms": matmul / steps,
        "attention_ms": attention / steps,
        "compiled_regions_ms": compiled / steps,
        "other_ops_ms": (total - matmul - attention - compiled) / steps,
        "python_ms": (1000 * wall - total) / steps,
        "ops_per_step": sum(e.count for e in events if e.key.startswith(("aten::", "mkldnn::"))) / steps,
    }


def _weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer (shared ones once),
    but only one row of an embedding table that is not also the LM head."""
    total = 0
    seen = set()
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if id(p) in seen or name.endswith("inv_freq"):
            continue
        seen.add(id(p))
        tied_float = model.lm_head is None and model.tied_head is None
        if "embed_tokens" in name and not tied_float:
            continue
        total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------- transformers


def run_transformers(dtype: str, quick: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loading.model_source import pull_demo

    torch.set_num_threads(THREADS)
    path = pull_demo()
    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype).eval()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        model(torch.tensor([_prompt(tok, 16)]))
        for n in PREFILL_LENGTHS:
            ids = torch.tensor([_prompt(tok, n)])
            rates = []
            for _ in range(PREFILL_REPEATS):
                t0 = time.perf_counter()
                model(ids, use_cache=False, logits_to_keep=1)
                rates.append(ids.shape[1] / (time.perf_counter() - t0))
            out[f"prefill_{n}"] = sorted(rates)[len(rates) // 2]
        decode_tokens = 32 if quick else 128
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        for streams in STREAMS if not quick else (1, 16):
            texts = [tok.decode(_prompt(tok, 24 + i)) for i in range(streams)]
            batch = tok(texts, return_tensors="pt", padding=True)
            kw = dict(do_sample=False, pad_token_id=tok.pad_token_id)
            t0 = time.perf_counter()
            model.generate(**batch, max_new_tokens=1, min_new_tokens=1, **kw)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(**batch, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, **kw)
            dt = time.perf_counter() - t0 - t_first
            out[f"decode_{streams}"] = streams * (decode_tokens - 1) / dt
    out["peak_rss_mb"] = _rss_mb()
    return out


# ---------------------------------------------------------------- llama.cpp


def llama_gguf(dtype: str) -> Path:
    """The demo GGUF as llama.cpp runs it: `q4_1` as shipped; `q8_0` requantized from it by
    llama.cpp's own quantizer (once, kept beside the models): its 8-bit format, for comparing
    bytes per weight like for like with our int8 (the values come from the 4-bit ones; only
    the speed is compared)."""
    from engine.loading.model_source import longctx_home, pull_demo

    src = pull_demo()
    if dtype == "q4_1":
        return src
    if dtype != "q8_0":
        raise ValueError(f"llama.cpp runs q4_1 or q8_0, not {dtype!r}")
    dst = longctx_home() / "bench" / f"{src.stem}.requantized-q8_0.gguf"
    if not dst.exists():
        import ctypes

        import llama_cpp

        dst.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, True, THREADS
        tmp = dst.with_suffix(".part")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError("llama.cpp could not requantize the demo model to q8_0")
        tmp.rename(dst)
    return dst


def run_llama_cpp(dtype: str, quick: bool) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(llama_gguf(dtype)), n_ctx=4096, n_threads=THREADS, n_batch=512, verbose=False)
    out: dict[str, Any] = {}
    for n in PREFILL_LENGTHS:
        ids = llm.tokenize(" ".join(f"Item {i}: the quick brown fox." for i in range(n)).encode())[:n]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        out[f"prefill_{n}"] = len(ids) / (time.perf_counter() - t0)
    decode_tokens = 32 if quick else 128
    no_eos = {llm.token_eos(): -1e9}
    short = llm.tokenize(b"Once upon a time, in a land far away,")
    long = llm.tokenize(" ".join(f"Item {i}: the quick brown fox." for i in range(2048)).encode())[:2048]
    for key, prompt in (("decode_1", short), ("decode_1_2k", long)):
        llm.reset()
        stream = llm.create_completion(
            prompt, max_tokens=decode_tokens, temperature=0.0, logit_bias=no_eos, stream=True
        )
        n, t_first = 0, 0.0
        for _ in stream:  # its own loop: sampling and detokenizing inside llama.cpp's generator
            n += 1
            if n == 1:
                t_first = time.perf_counter()
        out[key] = (n - 1) / (time.perf_counter() - t_first)
    out["peak_rss_mb"] = _rss_mb()
    return out


WORKERS = {"ours": run_ours, "transformers": run_transformers, "llama.cpp": run_llama_cpp}


def worker(system: str, dtype: str, quick: bool, profile: bool) -> None:
    if system == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        print(json.dumps({"error": "llama-cpp-python not installed (make bench-peers)"}))
        return
    result = run_ours(dtype, quick, profile) if system == "ours" else WORKERS[system](dtype, quick)
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens and stream counts")
    ap.add_argument("--systems", default="ours,transformers,llama.cpp")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8,int4", help="int8/int4: ours only")
    ap.add_argument("--profile", action="store_true", help="split one decode step of ours by time")
    ap.add_argument("--threads", type=int, default=None, help="threads per system (targets: 2)")
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "DTYPE"))
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="ours compiled")
    args = ap.parse_args()
    global THREADS, COMPILE
    THREADS = args.threads or THREADS
    COMPILE = COMPILE if args.compile is None else args.compile
    if args.worker:
        worker(args.worker[0], args.worker[1], args.quick, args.profile)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth_gbs()
    results: dict[str, Any] = {"bandwidth_gbs": bandwidth, "threads": THREADS, "compile": COMPILE, "runs": {}}
    results["read_bandwidth_gbs"] = read_bandwidth_gbs()
    results["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    for system in args.systems.split(","):
        dtypes = ["q4_1"] if system == "llama.cpp" else args.dtypes.split(",")
        if system == "transformers":
            dtypes = [d for d in dtypes if d not in QUANTIZED]
        for dtype in dtypes:
            cmd = [sys.executable, __file__, "--worker", system, dtype] + (["--quick"] if args.quick else [])
            cmd += ["--profile"] if args.profile and system == "ours" else []
            env = os.environ | {
                "OMP_NUM_THREADS": str(THREADS),
                "LONGCTX_BENCH_THREADS": str(THREADS),
                "LONGCTX_BENCH_COMPILE": "1" if COMPILE else "0",
            }
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            key = f"{system}/{dtype}"
            if proc.returncode != 0:
                results["runs"][key] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
            else:
                results["runs"][key] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{key}: {results['runs'][key]}", file=sys.stderr)
            (RESULTS / "engine_throughput.json").write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    bw = results["bandwidth_gbs"]
    runs = results["runs"]
    cols = ["prefill_512", "prefill_2048", "decode_1", "decode_1_2k", "decode_4", "decode_16", "decode_32"]
    cols += ["decode_1_4k", "decode_1_8k", "step_ms_1", "floor_ms", "peak_rss_mb"]
    read = results.get("read_bandwidth_gbs", float("nan"))
    print(f"copy bandwidth {bw:.1f} GB/s, read {read:.1f} GB/s, {results['threads']} threads; tokens/s unless noted")
    print(f"{'system':24}" + "".join(f"{c:>13}" for c in cols) + f"{'agreement':>11}{'step/floor':>11}{'ceiling%':>12}")
    for key, r in runs.items():
        if "error" in r:
            print(f"{key:24} error: {r['error']}")
            continue
        ag = r.get("agreement")
        extra = f"{'':>11}" if ag is None else f"{ag['decided']:>10.1%}" + (" " if ag["valid"] else " INVALID")
        if "floor_ms" in r:
            extra += f"{r['step_ms_1'] / r['floor_ms']:>10.2f}x"
        if "weight_bytes" in r:
            ceil = bw * 1e9 / (r["weight_bytes"] + 32 * r["kv_bytes_per_token"])
            extra += f"  {100 * r['decode_1'] / ceil:.0f}% of {ceil:.0f}"
        print(f"{key:24}" + "".join(f"{r.get(c, float('nan')):>13.1f}" for c in cols) + extra)
        if "profile" in r:
            print(f"{'':24}one decode step: " + ", ".join(f"{k} {v:.1f}" for k, v in r["profile"].items()))
        if "head_bf16_ms_1" in r:
            print(f"{'':24}LM head ms (float32 logits / bf16-rounded oneDNN it replaced): 1 row "
                  f"{r['head_ms_1']:.2f} / {r['head_bf16_ms_1']:.2f}, 16 rows {r['head_ms_16']:.2f} / "
                  f"{r['head_bf16_ms_16']:.2f}")  # fmt: skip
    # A row of ours whose output is under its agreement floor counts toward no target.
    runs = {k: r for k, r in runs.items() if r.get("agreement", {"valid": True})["valid"]}
    invalid = [k for k in results["runs"] if k not in runs]
    if invalid:
        print(f"  INVALID (under their agreement floor, left out of every ratio): {', '.join(invalid)}")
    ratios = {}
    for dt in ("float32", "bfloat16"):
        o, t = runs.get(f"ours/{dt}", {}), runs.get(f"transformers/{dt}", {})
        if "decode_1" in o and "decode_1" in t:
            for c in cols[:7]:
                if c in o and c in t:
                    ratios[f"{dt} {c} ours/transformers"] = o[c] / t[c]
    t32 = runs.get("transformers/bfloat16", {})
    if "decode_32" in t32 and "decode_32" in runs.get("ours/bfloat16", {}):
        ratios["bfloat16 decode_32 ours / transformers batch-32"] = (
            runs["ours/bfloat16"]["decode_32"] / t32["decode_32"]
        )
    lc = runs.get("llama.cpp/q4_1", {})
    for dt in ("bfloat16", "int8", "int4"):
        o = runs.get(f"ours/{dt}", {})
        if "decode_1" in lc and "decode_1" in o:
            ratios[f"{dt} decode_1 ours / llama.cpp decode_1"] = o["decode_1"] / lc["decode_1"]
            if "decode_16" in o:
                ratios[f"{dt} decode_16 ours / llama.cpp decode_1"] = o["decode_16"] / lc["decode_1"]
            if "decode_1_2k" in o and "decode_1_2k" in lc:
                ratios[f"{dt} decode_1_2k ours / llama.cpp"] = o["decode_1_2k"] / lc["decode_1_2k"]
        if "decode_1_2k" in o:
            ratios[f"{dt} decode after 2k / after 24 tokens"] = o["decode_1_2k"] / o["decode_1"]
        if "decode_1_4k" in o:
            ratios[f"{dt} decode after 4k / after 24 tokens"] = o["decode_1_4k"] / o["decode_1"]
        if "step_ms_1_8k" in o and "step_ms_1_256" in o:
            ratios[f"{dt} step after 8k / after 256 tokens"] = o["step_ms_1_8k"] / o["step_ms_1_256"]
            memory_bound_8k(dt, o)
        if "floor_ms" in o:
            ratios[f"{dt} step / matmul floor"] = o["step_ms_1"] / o["floor_ms"]
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    results["ratios"] = ratios
    results["targets"] = verdicts(ratios)
    for name, (value, target, met) in results["targets"].items():
        print(f"  target {name}: {value:.2f} vs {target} -> {'met' if met else 'MISSED'}")
    (RESULTS / "engine_throughput.json").write_text(json.dumps(results, indent=2))


def memory_bound_8k(dtype: str, r: dict[str, Any]) -> None:
    """What a step reads after 8k against after 256 tokens (weights once, K/V of every layer at
    the run's mean context), and the rate the extra K/V came in at: the 8k step's extra time
    against its extra bytes. A step bound by memory alone takes as long as its bytes need."""
    if "weight_bytes" not in r or "decode_tokens" not in r:
        return
    mean = r["decode_tokens"] / 2
    long, short = (
        r["weight_bytes"] + r["kv_bytes_per_token"] * (CONTEXTS[k] + mean) for k in ("decode_1_8k", "decode_1_256")
    )
    extra_s = (r["step_ms_1_8k"] - r["step_ms_1_256"]) / 1000
    r["bytes_8k_over_256"] = long / short
    r["extra_kv_gbs_8k"] = (long - short) / extra_s / 1e9 if extra_s > 0 else float("inf")
    print(
        f"  {dtype} bytes read per step after 8k / after 256 tokens: {r['bytes_8k_over_256']:.2f}x "
        f"({long / 1e6:.0f} / {short / 1e6:.0f} MB); the extra "
        f"{(long - short) / 1e6:.0f} MB of K/V came in at {r['extra_kv_gbs_8k']:.1f} GB/s"
    )


# The targets: (ratio key, at least / at most, bound).
TARGETS = {
    "step/floor bf16": ("bfloat16 step / matmul floor", "<=", 1.25),
    "step/floor int8": ("int8 step / matmul floor", "<=", 1.25),
    "step/floor int4": ("int4 step / matmul floor", "<=", 1.25),
    "bf16 decode vs transformers": ("bfloat16 decode_1 ours/transformers", ">=", 1.5),
    "int8 decode vs llama.cpp": ("int8 decode_1 ours / llama.cpp decode_1", ">=", 0.6),
    "int4 decode vs llama.cpp (moonshot)": ("int4 decode_1 ours / llama.cpp decode_1", ">=", 1.0),
    "16 streams vs llama.cpp single": ("bfloat16 decode_16 ours / llama.cpp decode_1", ">=", 4.0),
    "32 streams vs transformers batch-32": ("bfloat16 decode_32 ours / transformers batch-32", ">=", 1.5),
    "decode after 2k / 24": ("bfloat16 decode after 2k / after 24 tokens", ">=", 0.8),
    "decode after 4k / 24": ("bfloat16 decode after 4k / after 24 tokens", ">=", 0.7),
    "step after 8k / 256": ("bfloat16 step after 8k / after 256 tokens", "<=", 1.5),
    "prefill 512 bf16 vs transformers": ("bfloat16 prefill_512 ours/transformers", ">=", 1.5),
    "prefill 2048 bf16 vs transformers": ("bfloat16 prefill_2048 ours/transformers", ">=", 1.5),
    "prefill 512 f32 vs transformers": ("float32 prefill_512 ours/transformers", ">=", 1.0),
    "prefill 2048 f32 vs transformers": ("float32 prefill_2048 ours/transformers", ">=", 1.0),
}


def verdicts(ratios: dict[str, float]) -> dict[str, tuple[float, str, bool]]:
    out = {}
    for name, (key, op, bound) in TARGETS.items():
        if key in ratios:
            v = ratios[key]
            out[name] = (v, f"{op} {bound}", v <= bound if op == "<=" else v >= bound)
    return out


if __name__ == "__main__":
    main()
