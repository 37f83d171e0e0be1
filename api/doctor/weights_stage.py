"""Stage 2, weights: the manifest, load throughput and peak memory, and statistics of every
tensor, streamed while the loader reads it (no second pass over the files).

A NaN or Inf fails naming the tensor. An all-zero or constant tensor warns, and so does one
whose standard deviation is 100x off its siblings in other layers (one layer's `q_proj`
against the other layers' `q_proj`): the usual trace of a broken conversion or a corrupt shard.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import NamedTuple

import torch

from api.doctor.report import StageResult
from engine.loading.weights import LoadStats, SourceTensor

OFF_BY = 100.0
_LAYER = re.compile(r"\.layers\.\d+\.")


class TensorStats(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str  # as read
    file: str
    nbytes: int
    mean: float
    std: float
    absmax: float
    nan: int
    inf: int


class TensorStatsCollector:
    """The loader's `on_tensor` callback: statistics of each tensor as it streams in."""

    def __init__(self) -> None:
        self.stats: list[TensorStats] = []

    def __call__(self, t: SourceTensor, value: torch.Tensor) -> None:
        v = value.detach().reshape(-1).float()
        finite = torch.isfinite(v)
        nan = int(torch.isnan(v).sum())
        inf = int((~finite).sum()) - nan
        f = v[finite] if nan or inf else v
        mean = float(f.mean()) if f.numel() else 0.0
        std = float(f.std()) if f.numel() > 1 else 0.0
        absmax = float(f.abs().max()) if f.numel() else 0.0
        dtype = str(value.dtype).replace("torch.", "")
        self.stats.append(TensorStats(t.name, t.shape, dtype, t.file, t.nbytes, mean, std, absmax, nan, inf))


def _sibling_outliers(stats: list[TensorStats]) -> list[tuple[TensorStats, float]]:
    """Tensors whose std is OFF_BY x above or below the median of the same tensor in other layers."""
    groups: dict[str, list[TensorStats]] = defaultdict(list)
    for s in stats:
        if _LAYER.search(s.name):
            groups[_LAYER.sub(".layers.*.", s.name)].append(s)
    out = []
    for members in groups.values():
        if len(members) < 3:
            continue
        stds = sorted(s.std for s in members)
        median = stds[len(stds) // 2]
        for s in members:
            if median > 0 and s.std > 0 and not (1 / OFF_BY < s.std / median < OFF_BY):
                out.append((s, s.std / median))
    return out


def bytes_by_type(stats: list[TensorStats], files: list[str]) -> tuple[dict[str, int], str]:
    """Bytes per storage type: GGUF's quantization types from the file, else the dtypes as read."""
    by_type: dict[str, int] = defaultdict(int)
    if files and all(f.endswith(".gguf") for f in files):
        from gguf import GGUFReader

        for f in files:
            for t in GGUFReader(f).tensors:
                by_type[t.tensor_type.name] += int(t.n_bytes)
        return dict(by_type), "GGML types"
    for s in stats:
        by_type[s.dtype] += s.nbytes
    return dict(by_type), "dtypes"


def weights_stage(stats: list[TensorStats], load: LoadStats, peak_rss: int, st: StageResult) -> None:
    files = sorted({s.file for s in stats})
    by_dtype, kind = bytes_by_type(stats, files)
    worst = sorted(stats, key=lambda s: -s.absmax)[:5]
    rows: list[list[object]] = [[s.name, list(s.shape), s.mean, s.std, s.absmax] for s in worst]
    st.table(["largest tensors by absmax", "shape", "mean", "std", "absmax"], rows)
    st.note(
        f"{len(stats)} tensors in {len(files)} file(s); "
        + ", ".join(f"{d} {n / 1e6:.1f} MB" for d, n in sorted(by_dtype.items()))
        + f" (by {kind})"
    )
    mb_per_s = load.bytes_read / max(load.seconds, 1e-9) / 1e6
    st.note(
        f"loaded {load.bytes_read / 1e6:.1f} MB in {load.seconds:.2f} s ({mb_per_s:.1f} MB/s), "
        f"peak RSS {peak_rss / 1e9:.2f} GB"
    )
    st.data = {
        "tensors": [s._asdict() for s in stats],
        "files": files,
        "bytes_by_type": by_dtype,
        "gb_per_s": load.gb_per_s,
        "seconds": load.seconds,
        "peak_rss_bytes": peak_rss,
        "fingerprint": load.fingerprint,
    }
    for s in stats:
        if s.nan or s.inf:
            st.fail(f"tensor {s.name!r} ({s.file}) holds {s.nan} NaN and {s.inf} Inf values")
        elif s.std == 0 and s.absmax == 0:
            st.warn(f"tensor {s.name!r} is all zeros")
        elif s.std == 0 and len(s.shape) > 0 and s.shape[0] > 1:
            st.warn(f"tensor {s.name!r} is constant ({s.mean:.3g})")
    for s, ratio in _sibling_outliers(stats):
        st.warn(f"tensor {s.name!r}: std {s.std:.3g} is {ratio:.3g}x the median of the same tensor in other layers")
