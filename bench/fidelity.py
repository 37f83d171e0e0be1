"""Every path a start can choose, on the demo model, against eager float32.

    python bench/fidelity.py [--dtypes float32,bfloat16] [--quantizations none,int8,int4]
        [--steps eager,compiled] [--linears native,widened] [--attentions kernel,sdpa] [--threads 2]

Per cell (`engine/verify/paths.py`: dtype x step x quantization x this CPU's or the forced
emulated-bf16 linears x the C++ attention kernels or SDPA): teacher-forced top-1 agreement with
eager float32 over the fixed text's schedule (prefill and decode buckets, mixed steps), counted
where float32 decides for the cell's dtype and over all positions; the relative logit error; for
compiled cells the largest per-bucket error against the eager cell of the same kernels; and
whether greedy answers to three questions equal eager float32's. A cell under its agreement floor
(`engine/verify/bounds.py`) is marked INVALID. Prints a table and writes
bench/results/fidelity.json; docs/benchmarks.md's table comes from it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.engine import Engine, EngineConfig
from engine.loading.loader import LoadedModel, load
from engine.loading.model_source import pull_demo
from engine.model.compile_setup import compile_available
from engine.sampling_params import SamplingParams
from engine.verify.agreement import TEXT, TEXT_B, rel_error
from engine.verify.bounds import agreement_floor
from engine.verify.paths import TOKENS_A, TOKENS_B, ServingPath, compare, forced, reference, run_schedule

QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the boiling point of water in Celsius?",
)
ANSWER_TOKENS = 16


def answers(lm: LoadedModel, path: ServingPath) -> list[str]:
    """Greedy answers to QUESTIONS through an engine on `path` (call under `forced`)."""
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_bytes=64 << 20, compile=path.compiled))
    if path.attention == "sdpa":
        engine.runner.backend.kernel = None  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    handles = [engine.add_request(lm.tokenizer.apply_chat_template([{"role": "user", "content": q}]), params)
               for q in QUESTIONS]  # fmt: skip
    engine.run_until_idle()
    return [lm.tokenizer.decode(h.result()[0]) for h in handles]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quantizations", default="none,int8,int4")
    ap.add_argument("--steps", default="eager,compiled")
    ap.add_argument("--linears", default="native,widened")
    ap.add_argument("--attentions", default="kernel,sdpa")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = str(pull_demo())
    f32 = load(gguf, dtype="float32", progress=False)
    tok = f32.tokenizer
    a, b = tok.encode(TEXT)[:TOKENS_A], tok.encode(TEXT_B)[:TOKENS_B]
    ref = reference(f32.model, a, b)
    ref_answers = answers(f32, ServingPath("float32", False, "none", "native", "kernel"))
    steps = [s == "compiled" for s in args.steps.split(",")]
    if compile_available() is not None:
        steps = [s for s in steps if not s]
    cells = [
        ServingPath(dt, c, q, lin, att)
        for dt, c, q, lin, att in itertools.product(
            args.dtypes.split(","), steps, args.quantizations.split(","), args.linears.split(","),
            args.attentions.split(","),
        )
        if not (dt == "float32" and lin == "widened")
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    eager_runs: dict[tuple[str, str, str, str], Any] = {}
    for path in sorted(cells, key=lambda p: p.compiled):  # eager cells first: compiled ones compare with them
        t0 = time.perf_counter()
        with forced(path):
            lm = load(gguf, dtype=path.dtype, progress=False, quantization=path.quantization)
            run = run_schedule(lm.model, path, a, b)
            got = answers(lm, path)
        ag = compare(run, ref, path.torch_dtype)
        key = (path.dtype, path.quantization, path.linear, path.attention)
        row: dict[str, Any] = {"path": path.name, **ag._asdict(), "answers_equal": got == ref_answers}
        row["answers"] = got
        if path.compiled and key in eager_runs:
            eager = eager_runs[key]
            row["compiled_vs_eager"] = max(
                rel_error(run.logits[rows_], eager.logits[rows_]) for rows_ in run.by_bucket().values()
            )
        elif not path.compiled:
            eager_runs[key] = run
        floor = agreement_floor(path.torch_dtype, path.quantization)
        row["floor"], row["valid"] = floor, ag.finite and ag.decided >= floor
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{path.name}: {ag.describe()}; answers {'= float32' if row['answers_equal'] else got}", flush=True)
        del lm
    print_table(rows, ref_answers)
    out = Path(__file__).resolve().parent / "results" / "fidelity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"loadavg": _loadavg(), "threads": args.threads, "reference_answers": ref_answers,
                               "rows": rows}, indent=2))  # fmt: skip


def print_table(rows: list[dict[str, Any]], ref_answers: list[str]) -> None:
    print(f"\ndemo model, {TOKENS_A} + {TOKENS_B} teacher-forced tokens against eager float32; loadavg {_loadavg()}")
    print("eager float32 answers: " + " | ".join(a.strip() for a in ref_answers))
    head = f"{'path':42} {'top-1 decided':>14} {'overall':>8} {'logit err':>10} {'vs eager':>9} {'answers':>8}"
    print(head)
    for r in rows:
        vs = f"{r['compiled_vs_eager']:.1e}" if "compiled_vs_eager" in r else "-"
        mark = "" if r["valid"] else f"  INVALID (< {r['floor']:.0%})"
        same = "= f32" if r["answers_equal"] else "differ"
        print(f"{r['path']:42} {r['decided']:>14.1%} {r['overall']:>8.1%} {r['error']:>10.1e} {vs:>9} {same:>8}{mark}")


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
