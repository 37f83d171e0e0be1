"""Engine throughput on the demo model, side by side with transformers and llama.cpp.

Each (system, dtype) runs in its own subprocess so its peak RSS is its own. Measures:
single-stream decode tokens/s, prefill tokens/s at 512 and 2048 prompt tokens, aggregate
decode tokens/s at 1/4/16/32 concurrent streams, peak RSS; plus the machine's copy
bandwidth and each decode figure as a share of its ceiling (bytes of weights and KV read per
step over that bandwidth). Prints a table and writes JSON to bench/results/.

    python bench/engine_throughput.py [--quick] [--systems ours,transformers,llama.cpp]
"""

from __future__ import annotations

import argparse
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


def copy_bandwidth_gbs() -> float:
    """Bytes read + written per second copying 1 GiB (median of 5)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / sorted(times)[2] / 1e9


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


def run_ours(dtype: str, quick: bool) -> dict[str, Any]:
    import torch

    from engine.engine import Engine, EngineConfig
    from engine.loading.loader import load
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(2)
    loaded = load("smollm2-135m-instruct", dtype=dtype, progress=False)
    tok = loaded.tokenizer
    engine = Engine(loaded.model, tok, EngineConfig(kv_cache_bytes=512 << 20, max_num_batched_tokens=512))
    out: dict[str, Any] = {"load_s": loaded.stats.seconds}
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(_prompt(tok, 16), greedy)  # warm-up
    engine.run_until_idle()
    for n in PREFILL_LENGTHS:
        ids = _prompt(tok, n)
        t0 = time.perf_counter()
        engine.add_request(ids, greedy)
        engine.run_until_idle()
        out[f"prefill_{n}"] = len(ids) / (time.perf_counter() - t0)
    decode_tokens = 32 if quick else 128
    for streams in STREAMS if not quick else (1, 16):
        prompts = [_prompt(tok, 24 + i) for i in range(streams)]
        params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
        handles = [engine.add_request(p, params) for p in prompts]
        while any(r.num_computed < len(r.prompt_ids) + 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill and the first token of every stream
        steps0, gen0, t0 = engine.stats.steps, engine.stats.generated_tokens, time.perf_counter()
        engine.run_until_idle()
        dt = time.perf_counter() - t0
        for h in handles:
            list(h)
        out[f"decode_{streams}"] = (engine.stats.generated_tokens - gen0) / dt
        out[f"step_ms_{streams}"] = 1000 * dt / max(1, engine.stats.steps - steps0)
    out["weight_bytes"] = _weight_bytes_per_step(loaded.model)
    out["kv_bytes_per_token"] = engine.kv_spec.bytes_per_token
    out["peak_rss_mb"] = _rss_mb()
    return out


def _weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights a decode step reads: every matrix, but only one row of the embedding
    table (counted once more as the tied LM head when tied)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += p.numel() * p.element_size() if model.lm_head is None else 0
        else:
            total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------- transformers


def run_transformers(dtype: str, quick: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loading.model_source import pull_demo

    torch.set_num_threads(2)
    path = pull_demo()
    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype).eval()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        model(torch.tensor([_prompt(tok, 16)]))
        for n in PREFILL_LENGTHS:
            ids = torch.tensor([_prompt(tok, n)])
            t0 = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            out[f"prefill_{n}"] = ids.shape[1] / (time.perf_counter() - t0)
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


def run_llama_cpp(dtype: str, quick: bool) -> dict[str, Any]:
    from llama_cpp import Llama

    from engine.loading.model_source import pull_demo

    llm = Llama(model_path=str(pull_demo()), n_ctx=4096, n_threads=2, n_batch=512, verbose=False)
    out: dict[str, Any] = {}
    for n in PREFILL_LENGTHS:
        ids = llm.tokenize(" ".join(f"Item {i}: the quick brown fox." for i in range(n)).encode())[:n]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        out[f"prefill_{n}"] = len(ids) / (time.perf_counter() - t0)
    decode_tokens = 32 if quick else 128
    ids = llm.tokenize(b"Once upon a time, in a land far away,")
    llm.reset()
    llm.eval(ids)
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    out["decode_1"] = decode_tokens / (time.perf_counter() - t0)
    out["peak_rss_mb"] = _rss_mb()
    return out


WORKERS = {"ours": run_ours, "transformers": run_transformers, "llama.cpp": run_llama_cpp}


def worker(system: str, dtype: str, quick: bool) -> None:
    print(json.dumps(WORKERS[system](dtype, quick)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens and stream counts")
    ap.add_argument("--systems", default="ours,transformers,llama.cpp")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "DTYPE"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.quick)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth_gbs()
    results: dict[str, Any] = {"bandwidth_gbs": bandwidth, "threads": 2, "runs": {}}
    for system in args.systems.split(","):
        dtypes = ["q4_1"] if system == "llama.cpp" else args.dtypes.split(",")
        for dtype in dtypes:
            cmd = [sys.executable, __file__, "--worker", system, dtype] + (["--quick"] if args.quick else [])
            env = os.environ | {"OMP_NUM_THREADS": "2"}
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
    cols = ["prefill_512", "prefill_2048", "decode_1", "decode_4", "decode_16", "decode_32", "peak_rss_mb"]
    print(f"copy bandwidth {bw:.1f} GB/s, 2 threads; tokens/s unless noted")
    print(f"{'system':24}" + "".join(f"{c:>14}" for c in cols) + f"{'ceiling%':>10}")
    for key, r in runs.items():
        if "error" in r:
            print(f"{key:24} error: {r['error']}")
            continue
        ceiling = ""
        if "weight_bytes" in r:
            ceil = bw * 1e9 / (r["weight_bytes"] + 32 * r["kv_bytes_per_token"])
            ceiling = f"{100 * r['decode_1'] / ceil:.0f}% of {ceil:.0f}"
        print(f"{key:24}" + "".join(f"{r.get(c, float('nan')):>14.1f}" for c in cols) + f"  {ceiling}")
    ratios = {}
    for dt in ("float32", "bfloat16"):
        o, t = runs.get(f"ours/{dt}", {}), runs.get(f"transformers/{dt}", {})
        if "decode_1" in o and "decode_1" in t:
            for c in cols[:-1]:
                if c in o and c in t:
                    ratios[f"{dt} {c} ours/transformers"] = o[c] / t[c]
            if "decode_16" in o:
                ratios[f"{dt} decode_16 ours / transformers decode_1"] = o["decode_16"] / t["decode_1"]
    lc = runs.get("llama.cpp/q4_1", {})
    if "decode_1" in lc and "decode_16" in runs.get("ours/bfloat16", {}):
        ratios["bfloat16 decode_16 ours / llama.cpp decode_1"] = runs["ours/bfloat16"]["decode_16"] / lc["decode_1"]
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    results["ratios"] = ratios
    (RESULTS / "engine_throughput.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
