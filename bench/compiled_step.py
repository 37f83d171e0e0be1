"""The compiled decode step against the eager one on the demo model, side by side in one run.

Per linear kind (bf16, int8, int4 weight-only), each mode in its own subprocess: eager
(`--no-compile`), compiled with a cold compile cache (a fresh `$LONGCTX_HOME/compile`), and
compiled with that cache warm (a second start). Measures the startup (model load + engine +
compiling every bucket), single-stream decode tokens/s after a 24-token prompt, the step time
against the matmul-only floor (the step's linears called back to back, from
`engine_throughput.py`), and with `--profile` one step split into matmuls, attention, other
ops and Python. Prints a table and writes JSON to bench/results/.

    python bench/compiled_step.py [--quick] [--dtypes bfloat16,int8,int4] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
MODES = ("eager", "cold", "warm")


def worker(dtype: str, mode: str, model: str, tokens: int, threads: int, profile: bool) -> dict[str, Any]:
    import torch

    from bench.engine_throughput import _matmul_floor_ms, _profile_step, _prompt
    from engine.engine import Engine, EngineConfig
    from engine.loading.loader import load
    from engine.model.compiled import CompiledStep
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    quant = dtype if dtype in ("int8", "int4") else "none"
    loaded = load(model, dtype="bfloat16", progress=False, quantization=quant)
    t_load = time.perf_counter()
    config = EngineConfig(kv_cache_bytes=256 << 20, compile=mode != "eager", threads=threads)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    t_engine = time.perf_counter()
    if isinstance(engine.runner.step, CompiledStep):
        engine.runner.step.warm_up(config.page_size)
    t_compile = time.perf_counter()
    out: dict[str, Any] = {
        "startup_s": t_compile - t0,
        "load_s": t_load - t0,
        "engine_s": t_engine - t_load,
        "compile_s": t_compile - t_engine,
    }
    tok = loaded.tokenizer
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(_prompt(tok, 24), greedy)
    engine.run_until_idle()
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.add_request(_prompt(tok, 24), params)
    engine.step()  # the prompt and the first token
    gen0, t1 = engine.stats.generated_tokens, time.perf_counter()
    engine.run_until_idle()
    dt = time.perf_counter() - t1
    out["decode_tok_s"] = (engine.stats.generated_tokens - gen0) / dt
    out["step_ms"] = 1000 * dt / (engine.stats.generated_tokens - gen0)
    out["floor_ms"] = _matmul_floor_ms(loaded.model)
    if profile:
        out["profile"] = _profile_step(engine, tok)
    return out


def run(dtype: str, mode: str, home: Path, args: argparse.Namespace, model: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", dtype, mode, "--model", model, "--threads", str(args.threads)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--profile"] if args.profile else []
    env = os.environ | {"LONGCTX_HOME": str(home)}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="32 decode tokens instead of 128")
    ap.add_argument("--dtypes", default="bfloat16,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="split one decode step by time")
    ap.add_argument("--model", default=None, help="a .gguf or directory (default: the demo model)")
    ap.add_argument("--worker", nargs=2, metavar=("DTYPE", "MODE"))
    args = ap.parse_args()
    tokens = 32 if args.quick else 128
    if args.worker:
        dtype, mode = args.worker
        print(json.dumps(worker(dtype, mode, args.model, tokens, args.threads, args.profile)))
        return
    from engine.loading.model_source import pull_demo

    model = args.model or str(pull_demo())
    results: dict[str, Any] = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "rows": {}}
    # The decode kernel is built once per machine, like the model download: before any row, so
    # no row's startup counts its build; every row's home links to it.
    from engine.attention import cpu_kernel

    kernels = Path(tempfile.mkdtemp(prefix="longctx-compile-bench-kernels-"))
    cpu_kernel.load(kernels)
    for dtype in args.dtypes.split(","):
        home = Path(tempfile.mkdtemp(prefix="longctx-compile-bench-"))
        (home / "kernels").symlink_to(kernels)
        try:
            # cold first: it fills `home` (converted weights, compiled graphs) for warm and eager
            for mode in ("cold", "warm", "eager"):
                results["rows"][f"{dtype}/{mode}"] = r = run(dtype, mode, home, args, model)
                print(f"{dtype}/{mode}: {r}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(kernels, ignore_errors=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"compiled_step_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"\nwrote {path}")


def print_table(results: dict[str, Any]) -> None:
    print(f"load average before {' '.join(results['loadavg_before'])}, after {' '.join(results['loadavg_after'])}")
    cols = f"{'startup s':>10}{'compile s':>10}{'decode tok/s':>13}{'step ms':>9}{'floor ms':>9}{'step/floor':>11}"
    print(f"{'row':<16}{cols}")
    rows = results["rows"]
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<16} failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        ratio = r["step_ms"] / r["floor_ms"]
        print(
            f"{name:<16}{r['startup_s']:>10.1f}{r['compile_s']:>10.1f}{r['decode_tok_s']:>13.1f}"
            f"{r['step_ms']:>9.1f}{r['floor_ms']:>9.1f}{ratio:>11.2f}"
        )
        if "profile" in r:
            p = r["profile"]
            print(
                f"{'':<16}profile: step {p['step_ms']:.1f} ms = matmul {p['matmul_ms']:.1f} + attention "
                f"{p['attention_ms']:.1f} + other ops {p['other_ops_ms']:.1f} + Python {p['python_ms']:.1f}"
            )
    for dtype in {n.split("/")[0] for n in rows}:
        e, c, w = (rows.get(f"{dtype}/{m}", {}) for m in MODES)
        if all("startup_s" in x for x in (e, c, w)):
            print(
                f"{dtype}: compiled/eager decode {w['decode_tok_s'] / e['decode_tok_s']:.2f}x; startup warm/eager "
                f"{w['startup_s'] / e['startup_s']:.2f}x (target <= 1.5x), "
                f"cold/eager {c['startup_s'] / e['startup_s']:.2f}x"
            )


if __name__ == "__main__":
    main()
