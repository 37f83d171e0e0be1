"""Structured output on the demo model: coverage of 60 real-world JSON schemas, and what the
grammar costs in decode throughput.

Coverage (JSONSchemaBench sample in tests/data/jsonschemabench): compiled (xgrammar, strict),
generated (greedy, 512 tokens, all schemas in one batch, finished before the limit), valid
(`jsonschema`, draft 2020-12, formats on). Throughput: decode tokens/s with and without a
JSON-schema constraint at 1 and 16 concurrent streams (prefill excluded), and the batch mask-fill
time per step; the target is a cost of at most 5%. Prints tables, writes bench/results/structured.json.

    python bench/structured.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
BENCH = ROOT / "tests" / "data" / "jsonschemabench"

from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.loading.loader import LoadedModel, load  # noqa: E402
from engine.loading.model_source import pull_demo  # noqa: E402
from engine.request import FinishReason  # noqa: E402
from engine.sampling.grammar import GrammarHook, Matcher  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tools.grammar import GrammarCompiler, XGrammarHook  # noqa: E402
from tools.schema import InvalidSchema, validate_instance  # noqa: E402

# Long enough that neither run ends before `tokens`: the constraint never lets the string close early.
THROUGHPUT_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "story": {"type": "string", "minLength": 2000}},
    "required": ["title", "story"],
}


class TimedHook(XGrammarHook):
    """The xgrammar hook, timing each batch fill (the per-step cost the engine pays)."""

    def __init__(self) -> None:
        super().__init__(max_threads=2)
        self.fill_s: list[float] = []

    def fill(self, matchers: list[Matcher | None], bitmask: torch.Tensor) -> None:
        t0 = time.perf_counter()
        super().fill(matchers, bitmask)
        self.fill_s.append(time.perf_counter() - t0)


def make_engine(lm: LoadedModel, hook: GrammarHook, seqs: int = 64) -> Engine:
    cfg = EngineConfig(kv_cache_bytes=2 << 30, max_num_seqs=seqs, max_num_batched_tokens=4096, threads=2)
    return Engine(lm.model, lm.tokenizer, cfg, grammar_hook=hook)


def prompt(lm: LoadedModel, schema: Any) -> list[int]:
    text = json.dumps(schema)[:400]  # schemas run to 20k characters: the model sees their start
    messages = [
        {"role": "system", "content": "You answer with JSON only."},
        {"role": "user", "content": f"Give an example JSON value for this JSON schema:\n{text}"},
    ]
    return lm.tokenizer.apply_chat_template(messages)


def coverage(lm: LoadedModel, gc: GrammarCompiler, max_tokens: int) -> list[dict[str, Any]]:
    files = sorted(BENCH.glob("*/*.json"))
    rows: list[dict[str, Any]] = []
    hook = TimedHook()
    eng = make_engine(lm, hook, seqs=len(files))
    handles = []
    for f in files:
        schema = json.loads(f.read_text())
        row: dict[str, Any] = {"schema": f"{f.parent.name}/{f.name}", "compiled": False, "generated": False}
        row |= {"valid": False, "tokens": 0, "error": None}
        try:
            grammar = gc.json_schema(schema, where=f.name)
            row["compiled"] = True
            params = SamplingParams(max_tokens=max_tokens, temperature=0)
            handles.append((row, schema, eng.add_request(prompt(lm, schema), params, matcher=gc.matcher(grammar))))
        except InvalidSchema as e:
            row["error"] = str(e)
        rows.append(row)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        if eng.stats.steps % 32 == 0:
            fill = statistics.mean(hook.fill_s[-32:]) * 1e3 if hook.fill_s else 0.0
            print(f"step {eng.stats.steps}: {time.perf_counter() - t0:.0f} s, fill {fill:.1f} ms/step", file=sys.stderr)
    print(f"generated {len(handles)} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for row, schema, h in handles:
        ids, text, reason = h.result()
        row["tokens"], row["finish"] = len(ids), str(reason)
        row["generated"] = reason is FinishReason.STOP
        if not row["generated"]:
            row["error"] = f"finish {reason}"
            continue
        try:
            error = validate_instance(json.loads(text), schema)
        except json.JSONDecodeError as e:
            error = ("$", f"not JSON: {e}")
        row["valid"] = error is None
        row["error"] = None if error is None else f"{error[0]}: {error[1][:120]}"
    return rows


def decode_rate(lm: LoadedModel, gc: GrammarCompiler, streams: int, constrained: bool, tokens: int) -> dict[str, Any]:
    """Aggregate decode tokens/s over `tokens` steps after the prefill step, and mean fill ms/step."""
    hook = TimedHook()
    eng = make_engine(lm, hook)
    grammar = gc.json_schema(THROUGHPUT_SCHEMA)
    p = prompt(lm, THROUGHPUT_SCHEMA)
    for i in range(streams):
        params = SamplingParams(max_tokens=tokens + 1, temperature=1.0, seed=i, ignore_eos=True)
        eng.add_request(p, params, matcher=gc.matcher(grammar) if constrained else None)
    eng.step()  # prefill, and the first token
    generated0, t0 = eng.stats.generated_tokens, time.perf_counter()
    steps0 = eng.stats.steps
    eng.run_until_idle()
    dt = time.perf_counter() - t0
    fills = hook.fill_s[1:]
    return {
        "tokens_per_s": (eng.stats.generated_tokens - generated0) / dt,
        "step_ms": dt / max(1, eng.stats.steps - steps0) * 1e3,
        "fill_ms": statistics.mean(fills) * 1e3 if fills else 0.0,
    }


def throughput(lm: LoadedModel, gc: GrammarCompiler, tokens: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for streams in (1, 16):
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(repeats):  # interleaved, so that load from other processes hits both alike
            for constrained in (False, True):
                runs[constrained].append(decode_rate(lm, gc, streams, constrained, tokens))
        free = statistics.median(r["tokens_per_s"] for r in runs[False])
        bound = statistics.median(r["tokens_per_s"] for r in runs[True])
        fill = statistics.median(r["fill_ms"] for r in runs[True])
        step = statistics.median(r["step_ms"] for r in runs[True])
        out.append(
            {"streams": streams, "unconstrained_tok_s": free, "constrained_tok_s": bound,
             "cost_pct": 100 * (1 - bound / free), "fill_ms_per_step": fill, "fill_share_pct": 100 * fill / step}
        )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens: a smoke run")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per throughput run")
    ap.add_argument("--repeats", type=int, default=3, help="throughput runs per setting (median)")
    ap.add_argument("--skip-coverage", action="store_true", help="throughput only; keeps the file's coverage")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load(str(pull_demo()), dtype="bfloat16", progress=False)
    gc = GrammarCompiler(lm.tokenizer, lm.config.vocab_size)
    out: dict[str, Any] = {"quick": args.quick}
    if (RESULTS / "structured.json").exists():
        out |= {k: v for k, v in json.loads((RESULTS / "structured.json").read_text()).items() if k == "coverage"}
    if not args.skip_coverage:
        out["coverage"] = print_coverage(coverage(lm, gc, 64 if args.quick else 512))
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "structured.json").write_text(json.dumps(out, indent=2))  # kept if throughput is cut short
    tput = throughput(lm, gc, 16 if args.quick else args.tokens, 1 if args.quick else args.repeats)
    print(
        f"\n{'streams':>7} {'free tok/s':>10} {'json tok/s':>10} {'cost %':>7} {'fill ms/step':>12} {'fill % step':>11}"
    )
    for t in tput:
        print(
            f"{t['streams']:>7} {t['unconstrained_tok_s']:>10.1f} {t['constrained_tok_s']:>10.1f} {t['cost_pct']:>7.1f}"
            f" {t['fill_ms_per_step']:>12.2f} {t['fill_share_pct']:>11.1f}"
        )
    out["throughput"] = tput
    (RESULTS / "structured.json").write_text(json.dumps(out, indent=2))
    print(f"\nwrote {RESULTS / 'structured.json'}")


def print_coverage(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    totals = {k: sum(r[k] for r in rows) for k in ("compiled", "generated", "valid")}
    print(f"{'schema':44} {'compiled':>8} {'generated':>9} {'valid':>5} {'tokens':>6}  error")
    for r in rows:
        print(
            f"{r['schema']:44} {r['compiled']!s:>8} {r['generated']!s:>9} {r['valid']!s:>5} {r['tokens']:>6}"
            f"  {(r['error'] or '')[:70]}"
        )
    print(f"{'total of ' + str(n):44} {totals['compiled']:>8} {totals['generated']:>9} {totals['valid']:>5}")
    sys.stdout.flush()
    return {"total": n, **totals, "schemas": rows}


if __name__ == "__main__":
    main()
