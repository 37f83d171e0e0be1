"""Building and loading the CPU kernels as torch ops: `paged_decode.cpp` (decode, and the step's
K/V rows written in), `paged_prefill.cpp` (a prefill chunk) and `engine/model/linear_bf16.cpp`
(bf16 linears in float32 where the CPU emulates bf16).

The sources are compiled once with the C++ compiler inductor also uses (g++), against the
installed torch's headers and libraries, into one `<build dir>/paged_decode-<hash>.so`, as one
translation unit that includes every source: torch's headers, two thirds of a source's compile,
are then parsed once instead of once per source (on a 2-core AVX2 EPYC 12 s instead of 29 s).
The hash covers the sources, the flags, the way they are built, the torch version, the compiler
and the CPU's instruction sets (`-march=native`), so a change of any of them builds anew and a
second start only loads the file. Without a compiler (or if the build fails) `load` returns None with one warning and
attention uses the SDPA path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("longctx.attention")

# The attention kernels, and the bf16 linear for CPUs that emulate bf16 (engine/model/linear_bf16.py),
# built into the same library.
SOURCES = (
    *(Path(__file__).with_name(n) for n in ("paged_decode.cpp", "paged_prefill.cpp")),
    Path(__file__).parent.parent / "model" / "linear_bf16.cpp",
)
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)
DTYPES = (torch.float32, torch.bfloat16)  # of the queries and the cache
# -march=native: the build runs on the machine that serves. Fast math without
# finite-math-only: the kernel starts its running maxima at -inf.
CFLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
]

_lock = threading.Lock()
_op: Callable[..., torch.Tensor] | None = None
_store: Callable[..., None] | None = None
_prefill: Callable[..., torch.Tensor] | None = None
_linear_bf16: Callable[..., torch.Tensor] | None = None
_linear_int8: Callable[..., torch.Tensor] | None = None
_linear_bf16_f32: Callable[..., torch.Tensor] | None = None
_linear_int8_f32: Callable[..., torch.Tensor] | None = None
_int8_vnni = False
_prefill_paths: dict[tuple[torch.dtype, int], bool] = {}  # (dtype, head dim) -> the build has a path
_failed: str | None = None


def compiler() -> str | None:
    """The C++ compiler to build with: `$CXX`, else g++ or c++ on PATH (inductor's choice too)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@functools.cache
def cpu_flags() -> str:
    """The CPU's instruction set extensions (`-march=native` builds, and inductor's graphs, target
    them): a build made on another machine under a shared `$LONGCTX_HOME` is not loaded here."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine()


def cpu_flag_set() -> frozenset[str]:
    """`cpu_flags()` as a set of names (`avx512f`, `avx512_bf16`, ...)."""
    return frozenset(cpu_flags().split())


@functools.cache
def compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# How the sources become one library (part of the build's hash).
BUILD = "one translation unit"


def unity_source(directory: Path) -> Path:
    """A source file in `directory` that includes every one of `SOURCES` (each keeps its own
    includes, found beside it; their file-local names do not collide)."""
    unit = directory / "kernels.cpp"
    unit.write_text("".join(f'#include "{p.resolve()}"\n' for p in SOURCES))
    return unit


def _command(cxx: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, *CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(unity_source(out.parent)), "-o", str(out)]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*cmd, "-lc10", "-ltorch_cpu", "-lgomp"]


def _build(cxx: str, so: Path) -> None:
    """Build `so`, once among concurrent starts on one build directory (replicas or ranks starting
    together, test workers): the first takes the directory's lock and builds, the others wait for
    it and find the file."""
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(so.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if so.exists():
            return
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            partial = Path(tmp) / so.name
            subprocess.run(_command(cxx, partial), check=True, capture_output=True, text=True, timeout=600)
            partial.replace(so)  # atomic: a start without the lock sees a whole file or none
        log.info("built the attention kernels in %.1fs", time.perf_counter() - t0)


def load(build_dir: Path) -> Callable[..., torch.Tensor] | None:
    """`torch.ops.longctx.paged_decode`, built under `build_dir` if needed; None if it cannot be."""
    global _op, _store, _prefill, _linear_bf16, _linear_int8, _linear_bf16_f32, _linear_int8_f32, _int8_vnni, _failed
    with _lock:
        if _op is not None or _failed is not None:
            return _op
        cxx = compiler()
        if cxx is None:
            _failed = "no C++ compiler (g++) on PATH"
            log.warning("attention kernels not built (%s); using SDPA", _failed)
            return None
        digest = hashlib.sha256()
        for path in (*SOURCES, *HEADERS):
            digest.update(path.read_bytes())
        for part in (*CFLAGS, BUILD, torch.__version__, compiler_version(cxx), cpu_flags()):
            digest.update(part.encode())
        so = build_dir / f"paged_decode-{digest.hexdigest()[:16]}.so"
        try:
            if not so.exists():
                _build(cxx, so)
            torch.ops.load_library(str(so))
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            detail = e.stderr.strip().splitlines()[-1:] if isinstance(e, subprocess.CalledProcessError) else [str(e)]
            _failed = detail[0] if detail else type(e).__name__
            log.warning("attention kernels not built (%s); using SDPA", _failed)
            return None
        _op, _store, _prefill = (
            torch.ops.longctx.paged_decode,
            torch.ops.longctx.store_kv,
            torch.ops.longctx.paged_prefill,
        )
        if torch.ops.longctx.linear_bf16_supported():
            ops = torch.ops.longctx
            _linear_bf16, _linear_int8 = ops.linear_bf16, ops.linear_int8
            _linear_bf16_f32, _linear_int8_f32 = ops.linear_bf16_f32, ops.linear_int8_f32
            _int8_vnni = bool(ops.linear_int8_vnni())
            torch.library.register_fake("longctx::linear_bf16", _linear_shape)
            torch.library.register_fake("longctx::linear_int8", _int8_shape)
            torch.library.register_fake("longctx::linear_bf16_f32", _float_shape)
            torch.library.register_fake("longctx::linear_int8_f32", _float_shape)
        return _op


def loaded() -> Callable[..., torch.Tensor] | None:
    """The kernel if `load` has succeeded in this process, else None (never builds)."""
    return _op


def store_kv() -> Callable[..., None] | None:
    """`store_kv(cache, k, v, slots)` (the step's K/V rows copied in) once loaded, else None."""
    return _store


def linear_bf16() -> Callable[..., torch.Tensor] | None:
    """`linear_bf16(x [M, K], w [N, K], b [N] | None)` (bf16 in, float32 sums, bf16 out; K a
    multiple of 16) once loaded with an AVX-512 build, else None."""
    return _linear_bf16


def linear_int8() -> Callable[..., torch.Tensor] | None:
    """`linear_int8(x [M, K] bf16, w [N, K] int8, scales [N], widen=False)` (x W^T times each row's
    scale, bf16 out; K a multiple of 16) once loaded with an AVX-512 build, else None. With
    AVX512-VNNI (`int8_vnni`) x's rows are quantized to int16 and summed exactly in int32 unless
    `widen`, which widens the codes to float32 (float32 sums of the bf16 values)."""
    return _linear_int8


def traced_ops() -> str:
    """Which of the ops a compiled region may call are loaded in this process (the linears'
    kernels, and whether int8 multiplies by VNNI): a graph traced without them calls torch's
    own ops instead, so it is a different graph (`GraphStore.key`)."""
    return f"linear_bf16={_linear_bf16 is not None} linear_int8={_linear_int8 is not None} vnni={_int8_vnni}"


def int8_vnni() -> bool:
    """Whether the loaded int8 kernels multiply by AVX512-VNNI (x's rows quantized to int16, exact
    int32 sums; `linear_bf16.cpp`), unless called with `widen=True`."""
    return _int8_vnni


def linear_bf16_f32() -> Callable[..., torch.Tensor] | None:
    """`linear_bf16_f32(x [M, K] bf16, w [N, K] bf16, widen=False)` -> [M, N] float32 (float32 sums
    kept, not rounded to bf16: the LM head's logits) once loaded with an AVX-512 build, else None.
    With AVX512-BF16 it multiplies by VDPBF16PS unless `widen` (the emulated-bf16 CPUs' path)."""
    return _linear_bf16_f32


def linear_int8_f32() -> Callable[..., torch.Tensor] | None:
    """`linear_int8_f32(x [M, K] bf16, w [N, K] int8, scales [N], widen=False)` -> [M, N] float32, as
    `linear_int8` without the output's bf16 rounding, once loaded with an AVX-512 build, else None."""
    return _linear_int8_f32


def _int8_shape(x: torch.Tensor, w: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _float_shape(x: torch.Tensor, w: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def _linear_shape(x: torch.Tensor, w: torch.Tensor, _: torch.Tensor | None) -> torch.Tensor:
    """The linear ops' output for tracing (`torch.compile` calls them inside compiled regions)."""
    return x.new_empty((x.shape[0], w.shape[0]))


def prefill(dtype: torch.dtype, head_dim: int) -> Callable[..., torch.Tensor] | None:
    """`paged_prefill(q, cache, pages, q0, window, scale)` (one sequence's chunk against its
    cached keys, read in place) once loaded and where this build has a path for `dtype` and
    `head_dim` (with AVX-512: float32 and bf16; head dims 64 and 128), else None."""
    if _prefill is None:
        return None
    key = (dtype, head_dim)
    if key not in _prefill_paths:
        _prefill_paths[key] = bool(torch.ops.longctx.paged_prefill_supported(dtype, head_dim))
    return _prefill if _prefill_paths[key] else None
