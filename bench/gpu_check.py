"""Attention backends on a GPU: each checked against a float32 torch_paged reference, and timed.

    python bench/gpu_check.py                 # CUDA: torch_paged and flashinfer, bf16 and fp16
    python bench/gpu_check.py --cpu-selftest  # CPU: torch_paged only, small shapes and model
    python bench/gpu_check.py --prebuild DIR  # nvcc, no GPU: FlashInfer's kernels for these cases

FlashInfer compiles each kernel family (prefill or decode, dtype, window or not) with nvcc at
first use: on Hopper its FA3 prefill modules take minutes. `--prebuild DIR` builds exactly the
modules the GPU cases plan, for sm_90a, on any machine with nvcc (no GPU needed), and writes
them as `DIR/<module>/<module>.so`, FlashInfer's ahead-of-time layout: copied into the
installed package's `flashinfer/data/aot/`, they are loaded instead of compiled (a module
missing there is still compiled at first use).

The attention cases import only torch and `engine.attention`, so they run where nothing else
of longctx's dependencies is installed; then a random Llama runs through our runner and
`Engine` per backend (`bench/gpu_engine.py`), where transformers and the engine's
dependencies are there (else that part says what is missing). Cases: random prefill, chunked-prefill (new tokens after a
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

from bench.gpu_engine import engine_rows, sync_device  # noqa: E402
from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.registry import make_backend  # noqa: E402
from engine.attention.torch_paged import TorchPagedBackend  # noqa: E402
from engine.verify.agreement import rel_error  # noqa: E402

THRESHOLDS = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# A row "flashinfer+tc": decode steps on FlashInfer's tensor-core kernels, which our backend
# picks only above 4 query heads per KV head; timed beside the default at 4 (bf16, no window).
TENSOR_CORES = "+tc"
TENSOR_CORE_CASES = {("decode", torch.bfloat16)}
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
    # The tables leave out the pages wholly before every query's window, as the engine releases
    # them while serving (`first_pages`); otherwise every page of the context is in the table.
    released: bool = False


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
        Case("decode-window-released", (1,) * 64, decode_kv, window=512, released=True),
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
        Case("decode-window-released", (1,) * 6, decode_kv, window=5, released=True),
    ]


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall time of `fn` in milliseconds, after one warm-up call."""
    fn()
    sync_device(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync_device(device)
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
    if case.released:
        assert case.window is not None
        first = [max(0, kv - q - case.window + 1) // S for q, kv in zip(case.q_lens, case.kv_lens, strict=True)]
        live = [torch.tensor(t[f:], dtype=torch.int32) for t, f in zip(tables, first, strict=True)]
        meta = AttentionMetadata.from_tables(live, first, list(case.q_lens), list(case.kv_lens), S, device)
    else:
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
    released_ok = True
    if case.released:  # the reference over the whole tables gives the same: the left-out pages are unseen
        whole = TorchPagedBackend(H, KVH, D)
        whole.plan(AttentionMetadata.build(tables, list(case.q_lens), list(case.kv_lens), S, device))
        released_ok = rel_error(whole.forward(0, q32, k32, v32, cache32.clone(), case.window), expected) < 1e-5

    base = {
        "case": case.name,
        "dtype": str(dtype).replace("torch.", ""),
        "seqs": meta.batch_size,
        "tokens": T,
        "max_kv": max(case.kv_lens),
        "window": case.window,
        "threshold": THRESHOLDS[dtype],
        "ref_fp32_ms": ref_ms,
    }
    if case.released:
        base["released_matches_whole"] = released_ok
    rows = []
    for name in backends:
        c = cache.clone()
        try:
            backend = make_backend(name.removesuffix(TENSOR_CORES), device, H, KVH, D)
            if name.endswith(TENSOR_CORES):  # decode on FlashInfer's tensor-core (prefill) kernels
                backend.decode_tensor_cores = True  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            backend.plan(meta)
            sync_device(device)
            plan_ms = (time.perf_counter() - t0) * 1e3
            out = backend.forward(0, q, k, v, c, case.window)
            err = rel_error(out, expected)
            written = bool(
                torch.equal(c[meta.slot_pages, 0, meta.slot_offsets], k)
                and torch.equal(c[meta.slot_pages, 1, meta.slot_offsets], v)
            )

            def step(backend: Any = backend, c: torch.Tensor = c) -> torch.Tensor:
                return backend.forward(0, q, k, v, c, case.window)

            ms = time_ms(step, device, reps)
        except Exception as e:  # a backend that fails here is a failed row; the other cases still run
            rows.append(base | {"backend": name, "ok": False, "failure": f"{type(e).__name__}: {e}"[:2000]})
            continue
        finally:
            del c
        ok = err < THRESHOLDS[dtype] and written and released_ok
        measured = {"error": err, "kv_written": written, "ok": ok, "ms": ms, "plan_ms": plan_ms}
        rows.append(base | {"backend": name} | measured)
    return rows


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Atomically, so a reader (or a killed run) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'case':<22} {'dtype':<9} {'backend':<12} {'seqs':>4} {'tokens':>6} {'max_kv':>6} {'window':>6} "
    head += f"{'error':>9} {'limit':>7} {'ok':>3} {'ms':>9} {'fp32 ref ms':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        where = f"{r['case']:<22} {r['dtype']:<9} {r['backend']:<12} {r['seqs']:>4} {r['tokens']:>6} {r['max_kv']:>6} "
        where += f"{r['window'] or '-':>6} "
        if "failure" in r:
            print(where + f"FAILED: {r['failure'][:200]}")
            continue
        print(
            where + f"{r['error']:>9.2e} {r['threshold']:>7.0e} {'yes' if r['ok'] else 'NO':>3} "
            f"{r['ms']:>9.3f} {r['ref_fp32_ms']:>11.3f}"
        )


def print_engine(rows: list[dict[str, Any]]) -> None:
    head = f"{'engine':<9} {'backend':<12} {'logits error':>12} {'limit':>7} {'ok':>3} "
    head += f"{'tokens/s':>9}  {'greedy vs first backend':<24} greedy vs float32"
    print("\n" + head)
    for r in rows:
        if "skipped" in r or "failure" in r:
            print(
                f"{r.get('dtype', '-'):<9} {r.get('backend', '-'):<12} {r.get('skipped') or 'FAILED: ' + r['failure']}"
            )
            continue
        print(
            f"{r['dtype']:<9} {r['backend']:<12} {r['error']:>12.2e} {r['threshold']:>7.0e} "
            f"{'yes' if r['ok'] else 'NO':>3} {r['engine_tokens_per_s']:>9.1f}  "
            f"{r['greedy_vs_first_backend']:<24} {r['greedy_vs_float32']}"
        )


def prebuild(out_dir: Path, shape: Shape = GPU_SHAPE) -> int:
    """Compile the FlashInfer modules `gpu_cases` plan on sm_90a (an H100/H200) into `out_dir`.

    The module arguments repeat those `BatchPrefillWithPagedKVCacheWrapper.plan` and
    `BatchDecodeWithPagedKVCacheWrapper.plan` derive (flashinfer 0.5.3) for our backend: the
    plan's dtypes, int32 indptr, no positional encoding in the kernel, no soft cap, and
    prefill on FA3 (what `auto` picks on sm_90a for these arguments), plus the page module
    FA3's runs use to turn a page table into token offsets, and the FA2 prefill module the
    "+tc" decode rows run. A module whose name
    differs from the one planned on the GPU is simply compiled there, so a mismatch costs
    time, never correctness.
    """
    import shutil

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    from engine.attention.flashinfer import import_flashinfer

    import_flashinfer()
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.core import build_jit_specs
    from flashinfer.jit.page import gen_page_module

    D = shape.head_dim
    specs = [gen_page_module()]  # FA3 reads pages of more than one token through its offsets
    for dtype in (torch.bfloat16, torch.float16):
        for window in (False, True):
            args = (dtype, dtype, dtype, torch.int32, D, D, 0, window, False)
            specs.append(gen_batch_prefill_module("fa3", *args, False))  # the last: no fp16 QK reduction
            if shape.num_heads // shape.num_kv_heads <= 4:  # else decode runs the prefill kernels
                specs.append(gen_batch_decode_module(*args))
            if (("decode", dtype) in TENSOR_CORE_CASES) and not window:  # the "+tc" rows' decode
                specs.append(gen_batch_prefill_module("fa2", *args, False))
    t0 = time.perf_counter()
    print(f"prebuild: {len(specs)} modules: {', '.join(s.name for s in specs)}", flush=True)
    build_jit_specs(specs, verbose=False, skip_prebuilt=False)
    for spec in specs:
        dest = out_dir / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.jit_library_path, dest)
        print(f"  {dest} ({dest.stat().st_size / 2**20:.1f} MiB)")
    print(f"prebuild: {time.perf_counter() - t0:.0f} s")
    return 0


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
    parser.add_argument("--prebuild", type=Path, default=None, metavar="DIR", help="compile FlashInfer's modules")
    args = parser.parse_args(argv)
    if args.prebuild is not None:
        try:
            return prebuild(args.prebuild)
        except RuntimeError as e:  # flashinfer missing, or nvcc failed (its output is in the message)
            print(f"gpu_check --prebuild: {e}", file=sys.stderr)
            return 2

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
            extra = (
                ["flashinfer" + TENSOR_CORES]
                if "flashinfer" in backends and (case.name, dtype) in TENSOR_CORE_CASES
                else []
            )
            rows = run_case(case, shape, dtype, backends + extra, device, reps, seed=1000 + i)
            report["results"].extend(rows)
            write_json(out, report)
            for r in rows:
                said = r["failure"] if "failure" in r else f"error {r['error']:.2e}, {r['ms']:.3f} ms"
                print(f"  {r['case']} {r['dtype']} {r['backend']}: {said}", flush=True)
    dtypes = [torch.float32, torch.bfloat16] if device.type == "cpu" else [torch.bfloat16, torch.float16]
    report["engine"] = engine_rows(device, backends, dtypes)
    report["complete"] = True
    write_json(out, report)
    print()
    print_table(report["results"])
    print_engine(report["engine"])
    rows = report["results"] + [r for r in report["engine"] if "skipped" not in r]
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed; report: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
