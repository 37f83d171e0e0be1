"""Baselines: a run's layer-by-layer fingerprint on the fixed prompts, saved to compare later runs.

transformers reads the same files as we do, so it cannot see a bad file; a baseline saved from
a known-good run can. The file (JSON) holds the prompts' token ids and, per prompt, each layer's
attention and MLP output statistics (mean, std, absmax) with a fixed sample of values, and the
same for the logits. A later run of the same architecture (another revision of the weights,
kernel, dtype, quantization or sharding) runs the stored ids and names the first layer and
sub-module whose sample moves past the looser of the two dtypes' thresholds, relative to the
baseline's absmax of that output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from api.doctor.capture import Capture
from api.doctor.context import DoctorContext
from api.doctor.layer_compare import first_divergence
from api.doctor.report import StageResult
from api.doctor.tolerance import dtype_from_name, threshold

FORMAT = 1
SAMPLE = 256  # values kept per output


def _summary(t: torch.Tensor) -> dict[str, Any]:
    flat = t.reshape(-1)
    g = torch.Generator().manual_seed(flat.numel())
    index = torch.randperm(flat.numel(), generator=g)[:SAMPLE].sort().values
    return {
        "shape": list(t.shape),
        "mean": float(flat.mean()),
        "std": float(flat.std()) if flat.numel() > 1 else 0.0,
        "absmax": float(flat.abs().max()),
        "index": index.tolist(),
        "values": flat[index].tolist(),
    }


def _prompt_record(c: Capture) -> dict[str, Any]:
    return {
        "embed": _summary(c.embed),
        "layers": [{"attn": _summary(a), "mlp": _summary(m)} for a, m in zip(c.attn, c.mlp, strict=True)],
        "logits": _summary(c.logits),
    }


def save_baseline(ctx: DoctorContext, path: Path) -> None:
    c = ctx.loaded.config
    doc = {
        "format": FORMAT,
        "model": ctx.loaded.source.name,
        "architecture": c.architecture,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "dtype": ctx.dtype_name,
        "prompts": ctx.prompts,
        "runs": [_prompt_record(cap) for cap in ctx.ours],
    }
    path.write_text(json.dumps(doc) + "\n")


def _sample_error(t: torch.Tensor, rec: dict[str, Any]) -> float:
    """max |ours - baseline| over the sampled values, relative to the baseline's absmax."""
    if list(t.shape) != rec["shape"]:
        return float("inf")
    ours = t.reshape(-1)[torch.tensor(rec["index"], dtype=torch.int64)]
    base = torch.tensor(rec["values"], dtype=torch.float32)
    scale = max(rec["absmax"], 1e-30)
    return max(float((ours - base).abs().max()) / scale, abs(float(t.abs().max()) - rec["absmax"]) / scale)


def compare_baseline(ctx: DoctorContext, path: Path, st: StageResult) -> None:
    doc = json.loads(path.read_text())
    c = ctx.loaded.config
    mine = (c.architecture, c.num_layers, c.hidden_size, c.vocab_size)
    theirs = (doc["architecture"], doc["num_layers"], doc["hidden_size"], doc["vocab_size"])
    if doc.get("format") != FORMAT or mine != theirs:
        st.fail(f"baseline {path} is for {theirs}, this model is {mine}")
        return
    limit = threshold(ctx.dtype, dtype_from_name(doc["dtype"]))
    ours = ctx.ours

    def error(kind: str, layer: int | None) -> float:
        worst = 0.0
        for cap, run in zip(ours, doc["runs"], strict=True):
            if layer is None:
                e = _sample_error(getattr(cap, kind), run[kind])
            else:
                e = _sample_error(getattr(cap, kind)[layer], run["layers"][layer][kind])
            worst = max(worst, e)
        return worst

    found, rows = first_divergence(c.num_layers, error, limit)
    logits_err = error("logits", None)
    st.data["baseline"] = {"file": str(path), "dtype": doc["dtype"], "layers": rows, "logits_error": logits_err}
    if not st.columns:
        st.table(["layer", "attention vs baseline", "MLP vs baseline"], rows)
    else:  # beside the transformers errors
        st.table(
            [*st.columns, "attention vs baseline", "MLP vs baseline"],
            [[*r, *b[1:]] for r, b in zip(st.data["layers"], rows, strict=True)],
        )
    st.note(f"baseline {path.name} ({doc['dtype']}): logits error {logits_err:.2e}, threshold {limit:.0e}")
    if found is not None:
        st.fail(f"against baseline {path.name}: {found.where} diverges first, error {found.error:.2e} > {limit:.0e}")
