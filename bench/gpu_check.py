"""Attention backends on a GPU: each checked against a float32 torch_paged reference, and timed.

    python bench/gpu_check.py                 # CUDA: torch_paged and flashinfer, bf16 and fp16
    python bench/gpu_check.py --cpu-selftest  # CPU: torch_paged only, small shapes

Imports only torch and `engine.attention`, so it runs where nothing else of longctx's
dependencies is installed. Cases: random prefill, chunked-prefill (new tokens after a
cached context), decode and mixed batches, with and without a sliding window, over the
same paged cache `[num_pages, 2, page_size, KVH, D]` with shuffled page tables. Inputs
are drawn in the tested dtype and the reference runs on the same values in float32, so
the error (max|ours - ref| / max|ref|) measures the backend's arithmetic only; limits:
bfloat16 1e-2, float16 2e-3. The JSON is rewritten after every case, so a run cut short
still reports what it did. Exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.registry import make_backend  # noqa: E402
from engine.attention.torch_paged import TorchPagedBackend  # noqa: E402

THRESHOLDS = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu_check.json"
SELFTEST_OUT = ROOT / "bench" / "results" / "gpu_check_selftest.json"


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


@dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]  # new tokens per sequence
    kv_lens: tuple[int, ...]  # context per sequence after the step
    window: int | None = None


GPU_SHAPE = Shape(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
CPU_SHAPE = Shape(num_heads=4, num_kv_heads=2, head_dim=32, page_size=4)


def _lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def gpu_cases() -> list[Case]:
    decode_kv = tuple(_lengths(64, 100, 4000, 1))
    mixed_kv = (2048, 700, *_lengths(30, 50, 3500, 2))
    return [
        Case("prefill", (512, 1024, 2048, 3000), (512, 1024, 2048, 3000)),
        Case("chunked", (512, 256, 512, 300), (1500, 2600, 4000, 812)),
        Case("decode", (1,) * 64, decode_kv),
        Case("mixed", (512, 700, *(1,) * 30), mixed_kv),
        Case("chunked-window", (512, 256, 512, 300), (1500, 2600, 4000, 812), window=1024),
        Case("decode-window", (1,) * 64, decode_kv, window=512),
    ]


def cpu_cases() -> list[Case]:
    decode_kv = tuple(_lengths(6, 3, 40, 1))
    return [
        Case("prefill", (9, 17, 30), (9, 17, 30)),
        Case("chunked", (5, 8, 3), (20, 33, 11)),
        Case("decode", (1,) * 6, decode_kv),
        Case("mixed", (7, 12, 1, 1, 1), (7, 30, 5, 18, 40)),
        Case("chunked-window", (5, 8, 3), (20, 33, 11), window=6),
        Case("decode-window", (1,) * 6, decode_kv, window=5),
    ]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall time of `fn` in milliseconds, after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(
    case: Case, shape: Shape, dtype: torch.dtype, backends: list[str], device: torch.device, reps: int, seed: int
) -> list[dict[str, Any]]:
    """One batch: the float32 reference, then each backend in `dtype` on the same values."""
    H, KVH, D, S = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size
    g = torch.Generator().manual_seed(seed)
    pages = [-(-kv // S) for kv in case.kv_lens]
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(perm[start : start + n])
        start += n
    meta = AttentionMetadata.build(tables, list(case.q_lens), list(case.kv_lens), S, device)
    T = meta.num_tokens
    cache = torch.randn(num_pages, 2, S, KVH, D, generator=g).to(dtype).to(device)
    q = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    k = torch.randn(T, KVH, D, generator=g).to(dtype).to(device)
    v = torch.randn(T, KVH, D, generator=g).to(dtype).to(device)

    ref = TorchPagedBackend(H, KVH, D)
    ref.plan(meta)
    cache32 = cache.float()
    q32, k32, v32 = q.float(), k.float(), v.float()
    expected = ref.forward(0, q32, k32, v32, cache32, case.window)
    ref_ms = time_ms(lambda: ref.forward(0, q32, k32, v32, cache32, case.window), device, reps)

    rows = []
    for name in backends:
        backend = make_backend(name, device, H, KVH, D)
        c = cache.clone()
        t0 = time.perf_counter()
        backend.plan(meta)
        _sync(device)
        plan_ms = (time.perf_counter() - t0) * 1e3
        out = backend.forward(0, q, k, v, c, case.window)
        err = rel_err(out, expected)
        written = bool(
            torch.equal(c[meta.slot_pages, 0, meta.slot_offsets], k)
            and torch.equal(c[meta.slot_pages, 1, meta.slot_offsets], v)
        )

        def step(backend: Any = backend, c: torch.Tensor = c) -> torch.Tensor:
            return backend.forward(0, q, k, v, c, case.window)

        ms = time_ms(step, device, reps)
        threshold = THRESHOLDS[dtype]
        rows.append(
            {
                "case": case.name,
                "dtype": str(dtype).replace("torch.", ""),
                "backend": name,
                "seqs": meta.batch_size,
                "tokens": T,
                "max_kv": max(case.kv_lens),
                "window": case.window,
                "error": err,
                "threshold": threshold,
                "kv_written": written,
                "ok": err < threshold and written,
                "ms": ms,
                "plan_ms": plan_ms,
                "ref_fp32_ms": ref_ms,
            }
        )
        del c
    return rows


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Atomically, so a reader (or a killed run) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'case':<15} {'dtype':<9} {'backend':<12} {'seqs':>4} {'tokens':>6} {'max_kv':>6} {'window':>6} "
    head += f"{'error':>9} {'limit':>7} {'ok':>3} {'ms':>9} {'fp32 ref ms':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['case']:<15} {r['dtype']:<9} {r['backend']:<12} {r['seqs']:>4} {r['tokens']:>6} {r['max_kv']:>6} "
            f"{r['window'] or '-':>6} {r['error']:>9.2e} {r['threshold']:>7.0e} {'yes' if r['ok'] else 'NO':>3} "
            f"{r['ms']:>9.3f} {r['ref_fp32_ms']:>11.3f}"
        )


def flashinfer_status(device: torch.device) -> tuple[bool, str]:
    try:
        from engine.attention.flashinfer import import_flashinfer

        fi = import_flashinfer()
        make_backend("flashinfer", device, 8, 8, 128)  # builds its workspace: proves it works here
        return True, str(getattr(fi, "__version__", "unknown version"))
    except Exception as e:  # reported, not fatal: torch_paged is still checked
        return False, f"unavailable: {e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-selftest", action="store_true", help="run the torch_paged cases on CPU, small shapes")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON report (default {DEFAULT_OUT})")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    args = parser.parse_args(argv)

    if args.cpu_selftest:
        device, shape, cases, backends = torch.device("cpu"), CPU_SHAPE, cpu_cases(), ["torch_paged"]
        fi_note = "not checked (CPU self-test)"
        out, reps = args.out or SELFTEST_OUT, args.reps or 1
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device, nothing to check (--cpu-selftest exercises the script on CPU)")
            return 0
        device, shape, cases = torch.device("cuda"), GPU_SHAPE, gpu_cases()
        ok, fi_note = flashinfer_status(device)
        backends = ["torch_paged", "flashinfer"] if ok else ["torch_paged"]
        out, reps = args.out or DEFAULT_OUT, args.reps or 10
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "flashinfer": fi_note,
        "shape": vars(shape),
        "complete": False,
        "results": [],
    }
    print(f"gpu_check on {report['device']}: backends {', '.join(backends)}; flashinfer {fi_note}", flush=True)
    write_json(out, report)
    for i, case in enumerate(cases):
        for dtype in (torch.bfloat16, torch.float16):
            rows = run_case(case, shape, dtype, backends, device, reps, seed=1000 + i)
            report["results"].extend(rows)
            write_json(out, report)
            for r in rows:
                print(
                    f"  {r['case']} {r['dtype']} {r['backend']}: error {r['error']:.2e}, {r['ms']:.3f} ms", flush=True
                )
    report["complete"] = True
    write_json(out, report)
    print()
    print_table(report["results"])
    failed = [r for r in report["results"] if not r["ok"]]
    print(f"\n{len(report['results']) - len(failed)} passed, {len(failed)} failed; report: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
