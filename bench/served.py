"""Speed as served: ours through `longctx serve` (the `openai` client streaming), beside the
in-process engine and llama.cpp's own loop, every system in one run, on the demo model.

For each dtype of ours (float32, bf16, int8, int4 = weight-only linears, bf16 activations):
- served: `longctx serve` (the engine in its own process, `engine/process/main.py`), driven by
  `openai.AsyncOpenAI` over `/v1/chat/completions` with `stream: true` and usage;
- in-process: the same engine flags, `Engine` stepped on one thread of a worker process (the
  ceiling, as `bench/engine_throughput.py` runs it), the same chat prompts rendered by the
  model's template.
Measures: TTFT p50 (a short prompt, a fresh one each time: no prefix-cache hit); decode tokens/s
after the first token at 1, 4, 16 and 32 concurrent streams (aggregate, while all N decode: the
tokens every stream received from the last stream's first token to the first stream's last
token, over that time; in process all N prefill in one step and end together, while served
requests arrive a few ms apart, so the first stream decodes alone while the others prefill and
the last ones finish alone: that head and tail are left out on both sides, and the whole span,
from the first stream's first token to the last stream's end, is reported beside it);
single-stream decode after a 2k (and, without `--quick`, a 7k: the demo model's context is
8,192) token prompt; `longctx generate`'s single-stream decode (after its first token reached
stdout, the median of three runs). Greedy, so served and in-process generate the same text: the
run reports how many of its streams agree (a speed figure counts only beside that agreement).
llama.cpp (Q4_1, the same GGUF; and Q8_0, requantized from it by llama.cpp's own quantizer: its
8-bit format, against which our int8 is compared byte for byte as well) runs through its own
generation loop in the interpreter `--llama-python` names (one with llama-cpp-python), and is
skipped with a note otherwise.
Prints a table with served / in-process and the targets' verdicts, and writes JSON to
bench/results/served.json. Timing runs belong under `flock -x`.
`--rounds R` runs served and in process R times each per dtype, alternating which goes first
(and llama.cpp R times after ours): on a machine whose speed drifts by 10-30% over minutes, one
served run against one in-process run minutes later measures the drift. The table then shows
each figure's median over the rounds, and each target its per-round ratios (served against the
same round's in-process run) with the verdict on their median.

    python bench/served.py [--quick] [--dtypes float32,bfloat16,int8,int4] [--no-compile]
        [--llama-python PATH] [--threads 2] [--generate-dtypes int4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
STREAMS = (1, 4, 16, 32)
# Each row of the table: the model's dtype and its linears' quantization (float32 is what a
# start picks on a CPU without AVX-512, so it is measured there as served).
DTYPES = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
}
DTYPE_FLAGS = {
    name: ["--dtype", dtype] + (["--quantization", quant] if quant != "none" else [])
    for name, (dtype, quant) in DTYPES.items()
}
_seq = [0]


def chat_prompt(kind: str = "story") -> str:
    """A fresh prompt each call (no prefix-cache hit between runs) that makes the model write on."""
    _seq[0] += 1
    k = 100 * _seq[0]
    if kind == "story":
        return f"Write a long story about the dragon number {k} and its treasure."
    n = int(kind)  # a long prompt of about n tokens (an item is about 11 of the demo model's tokens)
    filler = " ".join(f"Item {k + i}: the quick brown fox." for i in range(n // 11))
    return f"{filler}\nNow write a long story about the dragon number {k}."


def plan(quick: bool) -> list[tuple[str, int, str, int]]:
    """(name, streams, prompt kind, max tokens) of each measurement, in order."""
    tokens = 48 if quick else 128
    rows = [("ttft", 1, "story", 1)] * 5
    rows += [(f"decode_{n}", n, "story", tokens if n <= 4 else tokens // 2) for n in STREAMS]
    rows += [("decode_1_2k", 1, "2000", tokens // 2)]
    if not quick:
        rows += [("decode_1_7k", 1, "7000", tokens // 2)]
    return rows


class Stream:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.end = 0.0
        self.tokens = 0
        self.text = ""
        self.events: list[tuple[float, int]] = []  # (when, tokens) of each chunk that carried tokens

    def got(self, n: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.events.append((now, n))


def summarize(name: str, streams: list[Stream]) -> dict[str, Any]:
    if name == "ttft":
        return {"ttft_ms": 1000 * ((streams[0].first or streams[0].end) - streams[0].start)}
    firsts = [s.first for s in streams if s.first is not None]
    after = sum(max(0, s.tokens - 1) for s in streams)
    span = max(s.end for s in streams) - min(firsts) if firsts else 0.0
    whole = after / span if span > 0 else 0.0
    # while all N decode: (last first token, first last token]
    lo = max(firsts) if len(firsts) == len(streams) else None
    hi = min(s.events[-1][0] for s in streams) if all(s.events for s in streams) else None
    if lo is None or hi is None or hi <= lo:
        steady = whole  # a stream ended before another's first token: no such window
    else:
        steady = sum(n for s in streams for t, n in s.events if lo < t <= hi) / (hi - lo)
    return {"tokens_per_s": steady, "whole_span_tokens_per_s": whole, "tokens": sum(s.tokens for s in streams)}


def collect(rows: list[tuple[str, list[Stream]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ttfts = [summarize(n, s)["ttft_ms"] for n, s in rows if n == "ttft"]
    out["ttft_p50_ms"] = statistics.median(ttfts) if ttfts else None
    for name, streams in rows:
        if name != "ttft":
            summary = summarize(name, streams)
            out[name] = summary["tokens_per_s"]
            out[name + "_whole_span"] = summary["whole_span_tokens_per_s"]
    out["texts"] = [s.text for n, ss in rows if n.startswith("decode") for s in ss]
    return out


# ---------------------------------------------------------------- served


async def stream_chat(client: Any, kind: str, max_tokens: int) -> Stream:
    """One fresh `chat_prompt(kind)` through `/v1/chat/completions`, streamed with usage."""
    s = Stream()
    stream = await client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": chat_prompt(kind)}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            s.got(1)
            s.text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            s.tokens = chunk.usage.completion_tokens
    s.end = time.perf_counter()
    return s


async def _served_rows(url: str, quick: bool) -> list[tuple[str, list[Stream]]]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    rows = []
    await stream_chat(client, "story", 8)  # the first request's one-off costs (the route's imports) stay out
    for name, n, kind, max_tokens in plan(quick):
        streams = await asyncio.gather(*(stream_chat(client, kind, max_tokens) for _ in range(n)))
        rows.append((name, list(streams)))
    await client.close()
    return rows


@contextlib.contextmanager
def demo_server(
    flags: list[str], redis_url: str, tag: str = "bench", root: Path = ROOT, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes], float]]:
    """`longctx serve` on the demo model from checkout `root` (its own Redis prefix, no KV Redis
    tier, no background workers), once ready and every bucket of its compiled step is in:
    (its URL, the process, seconds until `/ready` answered 200). Stopped on leaving."""
    from tests.server import free_port, http_get

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    home = tempfile.mkdtemp(prefix=f"lc-{tag}-")
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model", "smollm2-135m-instruct", "--port", str(port),
           "--served-model-name", "demo", "--kv-redis-url", "none", "--background-workers", "0",
           "--redis-url", redis_url, "--redis-prefix", f"{tag}{port}", *flags]  # fmt: skip
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("LONGCTX_HOME", str(Path.home() / ".cache" / "longctx"))
    log = open(Path(home) / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    try:
        t0 = time.perf_counter()
        while http_get(f"{url}/ready")[0] != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > 900:
                raise RuntimeError(f"server did not start: {(Path(home) / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.1)
        ready_s = time.perf_counter() - t0
        http_get(f"{url}/ready?wait_compiled_s=900", 910)  # the compiled step, every bucket
        yield url, proc, ready_s
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def run_served(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    _seq[0] = 0  # the same prompts as the in-process worker (a fresh process per dtype) gets
    flags = [*DTYPE_FLAGS[dtype], "--threads", str(args.threads), "--kv-cache-bytes", "1GiB", "--max-num-seqs", "32"]
    flags += ["--no-compile"] if args.no_compile else []
    with demo_server(flags, args.redis_url) as (url, _, ready_s):
        out = collect(asyncio.run(_served_rows(url, args.quick)))
        out["ready_s"] = ready_s
        out["split"] = _split(f"{url}/metrics")
        return out


def _split(url: str) -> dict[str, float]:
    """Where a token's time goes, from the server's own histograms over the whole run: the engine
    process's time between a request's tokens, and the channel's share of it (engine process
    sending a step's outputs -> the API process handing them to their requests), in ms."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)

    def mean_ms(name: str) -> float:
        n = values.get(f"{name}_count", 0.0)
        return 1000 * values.get(f"{name}_sum", 0.0) / n if n else float("nan")

    return {
        "engine_inter_token_ms": mean_ms("longctx:engine_inter_token_latency_seconds"),
        "channel_ms": mean_ms("longctx:engine_output_channel_seconds"),
        "engine_ttft_ms": mean_ms("longctx:engine_time_to_first_token_seconds"),
    }


# ---------------------------------------------------------------- in process


def run_in_process(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """The worker's side: the engine on this process's main thread, outputs timed as pushed."""
    import torch

    from api.engine_args import add_engine_args, want_compile
    from engine.engine import Engine
    from engine.engine_config import EngineConfig
    from engine.loading.loader import load
    from engine.request import RequestHandle
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    model_dtype, quant = DTYPES[dtype]
    loaded = load("smollm2-135m-instruct", model_dtype, progress=False, quantization=quant)
    engine_flags = argparse.ArgumentParser()
    add_engine_args(engine_flags)  # the engine flags' defaults, as `serve` starts (compile where it builds)
    compiled = not args.no_compile and want_compile(engine_flags.parse_args([]))
    config = EngineConfig(kv_cache_bytes=1 << 30, max_num_seqs=32, threads=args.threads, compile=compiled)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    if compiled:
        from engine.model.compiled import CompiledStep
        from engine.verify.self_check import warm_up_and_check

        assert isinstance(engine.runner.step, CompiledStep)
        warm_up_and_check(engine.runner.step, engine.kv_spec.page_size)
    tok = loaded.tokenizer

    class Timed(RequestHandle):
        def __init__(self, rid: str, s: Stream):
            super().__init__(rid, engine.abort)
            self.s = s

        def push(self, out: Any) -> None:
            if out.token_ids:
                self.s.got(len(out.token_ids))
            self.s.tokens += len(out.token_ids)
            self.s.text += out.text_delta
            if out.finish_reason is not None:
                self.s.end = time.perf_counter()
            super().push(out)

    def batch(kind: str, n: int, max_tokens: int) -> list[Stream]:
        streams = []
        for i in range(n):
            s = Stream()
            ids = tok.apply_chat_template([{"role": "user", "content": chat_prompt(kind)}])
            rid = f"r{_seq[0]}-{i}"
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            engine.add_request(ids, params, request_id=rid, handle=Timed(rid, s))
            streams.append(s)
        engine.run_until_idle()
        return streams

    batch("story", 1, 8)
    rows = [(name, batch(kind, n, mt)) for name, n, kind, mt in plan(args.quick)]
    return collect(rows)


def run_generate(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """`longctx generate` (through the engine process as well): decode tokens/s after the first
    token, as the served figure counts it, from when its text reaches stdout (it writes and
    flushes each token's text); the median of three runs."""
    import re

    n = 96 if args.quick else 160
    cmd = [sys.executable, "-m", "api.cli", "generate", "--model", "smollm2-135m-instruct", "--chat",
           "--prompt", "Write a long story about the dragon number 7 and its treasure.", "--temperature", "0",
           "--max-tokens", str(n), "--threads", str(args.threads), *DTYPE_FLAGS[dtype]]  # fmt: skip
    cmd += ["--no-compile"] if args.no_compile else []
    rates = []
    for _ in range(3):
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err)
            assert proc.stdout is not None
            first = last = None
            while chunk := os.read(proc.stdout.fileno(), 65536):
                now = time.perf_counter()
                first = first or now
                if chunk.strip():  # the final newline comes after the last token's text
                    last = now
            proc.wait(timeout=600)
            err.seek(0)
            log = err.read().decode(errors="replace")
        m = re.search(r"(\d+) generated in ([\d.]+)s", log)
        if m is None or first is None or last is None or last <= first:
            return {"error": log[-500:]}
        rates.append((int(m.group(1)) - 1) / (last - first))
    return {"decode_1": statistics.median(rates), "runs": rates}


def run_llama_cpp(python: str, quick: bool, threads: int, dtype: str = "q4_1") -> dict[str, Any]:
    """llama.cpp's own loop (`bench/engine_throughput.py`'s worker) in an interpreter that has it."""
    env = {**os.environ, "LONGCTX_BENCH_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [python, str(ROOT / "bench" / "engine_throughput.py"), "--worker", "llama.cpp", dtype]
    cmd += ["--quick"] if quick else []
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    try:
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": (r.stderr or r.stdout)[-500:]}


# ---------------------------------------------------------------- the run


def _worker(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # the ceiling: OpenMP's default
    cmd = [sys.executable, __file__, "--worker", dtype, "--threads", str(args.threads)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--no-compile"] if args.no_compile else []
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    try:
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": r.stderr[-1500:]}


def one_round(dtype: str, args: argparse.Namespace, served_first: bool) -> dict[str, dict[str, Any]]:
    """Served and in process once each, in the order given (rounds alternate it, so a drift of
    the machine's speed over a run falls on both sides alike)."""

    def served() -> dict[str, Any]:
        try:
            return run_served(dtype, args)
        except Exception as e:
            return {"error": str(e)}

    if served_first:
        s = served()
        return {"served": s, "in_process": _worker(dtype, args)}
    i = _worker(dtype, args)
    return {"served": served(), "in_process": i}


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric figure, the median over the rounds that measured it; the rest from the first
    round (texts, the server-side split); an error if every round failed."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return rows[0]
    out = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, float | int) and not isinstance(value, bool):
            values = [r[key] for r in ok if isinstance(r.get(key), float | int) and r[key] == r[key]]
            out[key] = statistics.median(values) if values else value
    return out


def without_texts(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "texts"}


def agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    ta, tb = a.get("texts", []), b.get("texts", [])
    same = sum(x == y for x, y in zip(ta, tb, strict=False))
    return f"{same}/{max(len(ta), len(tb))}"


METRICS = ["ttft_p50_ms", *(f"decode_{n}" for n in STREAMS), "decode_1_2k", "decode_1_7k"]
TARGETS = [  # (what, served key, against, bound)
    ("float32 single-stream served / in-process", "float32", "decode_1", "in", 0.9),
    ("bf16 single-stream served / in-process", "bfloat16", "decode_1", "in", 0.9),
    ("int8 single-stream served / in-process", "int8", "decode_1", "in", 0.9),
    ("int4 single-stream served / in-process", "int4", "decode_1", "in", 0.9),
    ("int4 served / llama.cpp", "int4", "decode_1", "llama", 1.0),
    ("int8 served / llama.cpp", "int8", "decode_1", "llama", 0.8),
    ("int8 served / llama.cpp q8_0 (8-bit against 8-bit; no target)", "int8", "decode_1", "llama_q8_0", None),
    ("bf16 16 streams served / in-process", "bfloat16", "decode_16", "in", 0.9),
]


def round_ratios(results: dict[str, Any], r: dict[str, Any], key: str, against: str) -> list[float]:
    """Each round's served figure over its base: the same round's in-process run, or llama.cpp's
    run of the same index (llama.cpp runs after ours, once per round)."""
    rounds = r.get("rounds", [])
    bases = {"in": [x["in_process"] for x in rounds], "llama": results.get("llama.cpp rounds", []),
             "llama_q8_0": results.get("llama.cpp q8_0 rounds", [])}[against]  # fmt: skip
    out = []
    for x, base in zip(rounds, bases, strict=False):
        a, b = x["served"].get(key), base.get(key)
        if a and b:
            out.append(a / b)
    return out


def report(results: dict[str, Any]) -> None:
    print(f"\nload average {os.getloadavg()}; threads {results['threads']}; compiled {results['compiled']}")
    header = f"{'system':<22}" + "".join(f"{m:>13}" for m in METRICS) + f"{'agree':>8}"
    print(header)
    for dtype, r in results["ours"].items():
        for side in ("served", "in_process"):
            row = r.get(side, {})
            if "error" in row:
                print(f"{dtype + ' ' + side:<22} error: {row['error'][-300:]}")
                continue
            cells = "".join(f"{row.get(m) or float('nan'):>13.1f}" for m in METRICS)
            print(f"{dtype + ' ' + side:<22}{cells}{r.get('agree', ''):>8}")
        s, i = r.get("served", {}), r.get("in_process", {})
        ratios = [f"{(s.get(m) or 0) / i[m]:.2f}" if i.get(m) else "-" for m in METRICS[1:]]
        print(f"{dtype + ' served/in':<22}{'':>13}" + "".join(f"{x:>13}" for x in ratios))
        spans = [f"{(s.get(m + '_whole_span') or 0) / i[m + '_whole_span']:.2f}" if i.get(m + "_whole_span") else "-"
                 for m in METRICS[1:]]  # fmt: skip
        print(f"{'  (whole span)':<22}{'':>13}" + "".join(f"{x:>13}" for x in spans))
        g = r.get("generate")
        if g is not None:
            print(f"{dtype + ' generate':<22}{'':>13}{g.get('decode_1') or float('nan'):>13.1f}")
    for dtype, r in results["ours"].items():
        split = r.get("served", {}).get("split")
        if split:
            print(f"{dtype} served, server-side means: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    lc = results.get("llama.cpp", {})
    for name, row in (("llama.cpp q4_1", lc), ("llama.cpp q8_0", results.get("llama.cpp q8_0"))):
        if row is None:
            continue
        if "error" in row:
            print(f"{name}: skipped ({row['error'][-200:]})")
        else:
            print(
                f"{name:<22}{'':>13}{row.get('decode_1', 0):>13.1f}" + " " * 39 + f"{row.get('decode_1_2k', 0):>13.1f}"
            )
    print("\ntargets:")
    verdicts = {}
    for what, dtype, key, against, bound in TARGETS:
        r = results["ours"].get(dtype)
        if r is None:
            continue
        served = r.get("served", {}).get(key)
        bases = {"in": r.get("in_process", {}), "llama": lc, "llama_q8_0": results.get("llama.cpp q8_0", {})}
        base = bases[against].get(key)
        per_round = round_ratios(results, r, key, against)
        if per_round:  # each round's ratio (served against the same round's base); the verdict on their median
            ratio = statistics.median(per_round)
            verdict = f" ({'met' if ratio >= bound else 'MISSED'}, >= {bound})" if bound else ""
            met = f"; met in {sum(x >= bound for x in per_round)} of {len(per_round)}" if bound else ""
            rounds = ", ".join(f"{x:.2f}" for x in per_round)
            verdicts[what] = f"{ratio:.2f}{verdict} (rounds: {rounds}{met})"
        elif not served or not base:
            verdicts[what] = "not measured"
        else:
            ratio = served / base
            verdict = f" ({'met' if ratio >= bound else 'MISSED'}, >= {bound})" if bound else ""
            verdicts[what] = f"{ratio:.2f}{verdict}"
        print(f"  {what}: {verdicts[what]}")
    for dtype, r in results["ours"].items():
        s, i = r.get("served", {}), r.get("in_process", {})
        g = r.get("generate", {}).get("decode_1")
        if g and s.get("decode_1"):
            ratio = g / s["decode_1"]
            verdicts[f"{dtype} generate / serve"] = (
                f"{ratio:.2f} ({'met' if abs(ratio - 1) <= 0.1 else 'MISSED'}, within 10%)"
            )
            print(f"  {dtype} generate vs serve single-stream: {verdicts[f'{dtype} generate / serve']}")
        overs = [x["served"]["ttft_p50_ms"] - x["in_process"]["ttft_p50_ms"] for x in r.get("rounds", [])
                 if x["served"].get("ttft_p50_ms") and x["in_process"].get("ttft_p50_ms")]  # fmt: skip
        if overs:
            over = statistics.median(overs)
            rounds = ", ".join(f"{x:.1f}" for x in overs)
            verdicts[f"{dtype} TTFT overhead"] = (
                f"{over:.1f} ms ({'met' if over <= 10 else 'MISSED'}, <= 10 ms) (rounds: {rounds} ms; "
                f"met in {sum(x <= 10 for x in overs)} of {len(overs)})"
            )
            print(f"  {dtype} TTFT overhead of the HTTP path: {verdicts[f'{dtype} TTFT overhead']}")
        elif s.get("ttft_p50_ms") and i.get("ttft_p50_ms"):
            over = s["ttft_p50_ms"] - i["ttft_p50_ms"]
            verdicts[f"{dtype} TTFT overhead"] = f"{over:.1f} ms ({'met' if over <= 10 else 'MISSED'}, <= 10 ms)"
            print(f"  {dtype} TTFT overhead of the HTTP path: {verdicts[f'{dtype} TTFT overhead']}")
    results["verdicts"] = verdicts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtypes", default="bfloat16,int8,int4")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", default=sys.executable)
    ap.add_argument("--generate-dtypes", default="int4", help="dtypes whose `longctx generate` is timed too")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="served and in process this many times each, alternating which goes first; the table shows "
        "medians, the targets each round's ratio too",
    )  # fmt: skip
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "served.json"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_in_process(args.worker, args)))
        return
    results: dict[str, Any] = {"threads": args.threads, "compiled": not args.no_compile, "ours": {}}
    t0 = time.perf_counter()
    for dtype in args.dtypes.split(","):
        rounds = [one_round(dtype, args, served_first=i % 2 == 0) for i in range(args.rounds)]
        r: dict[str, Any] = {
            "served": median_row([x["served"] for x in rounds]),
            "in_process": median_row([x["in_process"] for x in rounds]),
            "agree": agreement(rounds[0]["served"], rounds[0]["in_process"]),
        }
        if args.rounds > 1:
            r["rounds"] = [{side: without_texts(x[side]) for side in ("served", "in_process")} for x in rounds]
        if dtype in args.generate_dtypes.split(","):
            r["generate"] = run_generate(dtype, args)
        results["ours"][dtype] = r
        print(f"{dtype}: done at {time.perf_counter() - t0:.0f} s", flush=True)
    llama = [run_llama_cpp(args.llama_python, args.quick, args.threads) for _ in range(args.rounds)]
    results["llama.cpp"] = median_row(llama)
    if args.rounds > 1:
        results["llama.cpp rounds"] = llama
    if "int8" in results["ours"]:
        q8 = [run_llama_cpp(args.llama_python, args.quick, args.threads, "q8_0") for _ in range(args.rounds)]
        results["llama.cpp q8_0"] = median_row(q8)
        if args.rounds > 1:
            results["llama.cpp q8_0 rounds"] = q8
    results["seconds"] = time.perf_counter() - t0
    results["loadavg"] = os.getloadavg()
    report(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for r in results["ours"].values():  # the texts stay out of the JSON (their agreement is in)
        for side in ("served", "in_process"):
            r.get(side, {}).pop("texts", None)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
