"""Stage 3a, reference: our model against transformers on the same files.

transformers reads the same weights through its own code, so a difference is our fault: a
loader mapping, a conversion (GGUF's Q/K un-permutation), a kernel, RoPE. It cannot catch a bad
file; baselines (`api/doctor/baseline.py`) do that.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from api.doctor.capture import Capture, capture_reference, rel_error
from api.doctor.context import DoctorContext
from api.doctor.layer_compare import first_divergence
from api.doctor.report import StageResult
from api.doctor.tolerance import threshold
from engine.loading.model_source import ModelPath

log = logging.getLogger("longctx.doctor")


def available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def load_transformers(source: ModelPath, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return model.eval()


def _error(ours: list[Capture], ref: list[Capture]) -> Any:
    def error(kind: str, layer: int | None) -> float:
        worst = 0.0
        for a, b in zip(ours, ref, strict=True):
            x, y = (
                (getattr(a, kind)[layer], getattr(b, kind)[layer])
                if layer is not None
                else (getattr(a, kind), getattr(b, kind))
            )
            worst = max(worst, rel_error(x, y))
        return worst

    return error


def _greedy_ours(ctx: DoctorContext, ids: list[int], n: int) -> list[int]:
    from engine.engine import Engine, EngineConfig
    from engine.sampling_params import SamplingParams

    model = ctx.loaded.model
    c = model.config
    per_token = 2 * c.num_layers * model.local_kv_heads * c.head_dim * ctx.dtype.itemsize
    config = EngineConfig(kv_cache_bytes=(len(ids) + n + 64) * per_token, attention_backend="auto")
    engine = Engine(model, None, config)
    handle = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    engine.run_until_idle()
    return handle.result()[0]


def _greedy_reference(hf: Any, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
        )
    return [int(t) for t in out[0, len(ids) :]]


def _skip(ctx: DoctorContext, st: StageResult, reason: str) -> None:
    """Not comparing with transformers is a skip, or only a note when a baseline is compared."""
    (st.note if ctx.options.baseline is not None else st.skip)(f"transformers comparison skipped: {reason}")


def reference_stage(ctx: DoctorContext, st: StageResult) -> None:
    opts = ctx.options
    if opts.reference == "none":
        _skip(ctx, st, "--reference none")
        return
    if ctx.loaded.config.vision is not None:
        _skip(ctx, st, "a vision-language checkpoint: the vision stage compares it with transformers")
        return
    if opts.device != "cpu":
        st.note("transformers runs on the CPU; our model on " + opts.device)
    hf = ctx.reference_model
    if hf is None:
        need = sum(p.numel() for p in ctx.loaded.model.parameters()) * ctx.dtype.itemsize
        if need * 1.5 > available_bytes():
            _skip(ctx, st, f"transformers' copy needs about {need / 1e9:.1f} GB, more than the memory available")
            return
        t0 = time.perf_counter()
        try:
            hf = load_transformers(ctx.loaded.source, ctx.dtype)
        except Exception as e:  # transformers may not implement this architecture or file
            _skip(ctx, st, f"transformers cannot load this checkpoint: {type(e).__name__}: {str(e)[:200]}")
            return
        st.note(f"transformers loaded the checkpoint in {time.perf_counter() - t0:.1f} s")
    limit = threshold(ctx.dtype)
    ref = capture_reference(hf, ctx.prompts)
    ours = ctx.ours
    found, rows = first_divergence(ctx.loaded.config.num_layers, _error(ours, ref), limit)
    logits_err = _error(ours, ref)("logits", None)
    agree = [float((a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean()) for a, b in zip(ours, ref, strict=True)]
    st.table(["layer", "attention err", "MLP err"], rows)
    st.data = {"layers": rows, "logits_error": logits_err, "top1_agreement": agree, "threshold": limit}
    st.note(
        f"logits relative error {logits_err:.2e} (threshold {limit:.0e}); top-1 agreement per prompt "
        + ", ".join(f"{a:.0%}" for a in agree)
    )
    if found is not None:
        st.fail(f"{found.where}: relative error {found.error:.2e} > {limit:.0e} (first past the threshold)")
    n = opts.greedy_tokens
    if n and st.status != "fail":
        ours_ids = _greedy_ours(ctx, ctx.prompts[0], n)
        ref_ids = _greedy_reference(hf, ctx.prompts[0], n)
        same = next((i for i, (a, b) in enumerate(zip(ours_ids, ref_ids, strict=True)) if a != b), None)
        st.data["greedy"] = {"ours": ours_ids, "transformers": ref_ids}
        if same is None:
            st.note(f"greedy: {n} tokens equal to transformers'")
        else:
            st.warn(f"greedy tokens diverge from transformers' at step {same} of {n} (a near-tie or an error)")
