"""Stage 3b, serving: the configuration `longctx serve` would run, against eager float32.

The other stages check the model in the doctor's dtype (float32 by default), eager. What users
get is `--dtype auto` (bf16 where the CPU is fast at it), the compiled step, this CPU's kernels
and any `--quantization`. This stage loads that configuration and compares it with eager float32:

- per step bucket, every layer's outputs (the residual stream after attention, and the MLP's
  output) on a fresh prefill of the fixed text's first tokens; the first layer past the dtype's
  threshold is named with its bucket, and for the compiled step the region (`pre_attention`,
  `post_attention`) whose compiled graph differs most from its own eager function there;
- teacher-forced top-1 agreement over the fixed text (`engine/verify/paths.py`'s schedule:
  prefill and decode buckets, mixed steps), where float32 decides for the served dtype.

Quantized weights move every layer's output by design, so with `--quantization` the per-layer
errors are reported and only the agreement (and non-finite values) can fail.
"""

from __future__ import annotations

from typing import Any

import torch

from api.doctor.context import DoctorContext
from api.doctor.report import StageResult
from api.doctor.tolerance import threshold
from engine.loading.loader import LoadedModel, load
from engine.model.compile_setup import compile_available
from engine.model.compiled import CompiledStep
from engine.model.model import CausalLM
from engine.model.moe import SparseMoE
from engine.model.regions import post_attention, pre_attention
from engine.model_runner import Chunk
from engine.verify.agreement import TEXT, TEXT_B, rel_error
from engine.verify.paths import TOKENS_A, TOKENS_B, ServingPath, compare, reference, run_schedule, runner_for
from kvstore.block_pool import BlockPool

# Floors of top-1 agreement with float32 (where it decides), per quantization.
AGREEMENT = {"none": 0.95, "int8": 0.90, "int4": 0.80}
BUCKETS = (1, 4, 16)  # the schedule's buckets
LayerOut = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (h after attention, MLP output)


def _ids(tok: Any, text: str, n: int) -> list[int]:
    ids = tok.encode(text)
    while len(ids) < n:  # a tokenizer with long tokens: the text again
        ids += tok.encode(" " + text)
    return ids[:n]


def _served(ctx: DoctorContext) -> LoadedModel:
    """The served configuration: the caller's (`run_stages(..., served=)`), the doctor's own model
    when it is that configuration, else loaded."""
    o = ctx.options
    if ctx.served is not None:
        return ctx.served
    if o.serve_dtype == ctx.dtype_name and o.quantization == "none":
        return ctx.loaded
    return load(
        str(ctx.loaded.source.path),
        o.serve_dtype,
        o.device,
        quantization=o.quantization,
        group_size=o.group_size,
        progress=False,
    )


def _reference(ctx: DoctorContext) -> CausalLM:
    if ctx.dtype == torch.float32:
        return ctx.loaded.model
    return load(str(ctx.loaded.source.path), "float32", ctx.options.device, progress=False).model


@torch.inference_mode()
def _layers(model: CausalLM, compiled: bool, ids: list[int]) -> tuple[LayerOut, dict[int, tuple[str, float]]]:
    """Per layer (h, MLP output) of a fresh prefill of `ids`; and for the compiled step, per layer
    the worst region's error against its own eager function: {layer: (region, error)}."""
    runner = runner_for(model, compiled, "kernel")
    seen: dict[int, list[torch.Tensor]] = {}
    regions: dict[int, tuple[str, float]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if not compiled:
            hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, [out[1], out[0]])))
        elif isinstance(layer.mlp, SparseMoE):  # experts run eager after the compiled region
            hooks.append(layer.mlp.register_forward_hook(lambda _m, _a, out, i=i: seen[i].__setitem__(1, out)))

    def observe(_b: int, layer: int, which: int, args: tuple[Any, ...], out: Any) -> None:
        ref = (post_attention if which else pre_attention)(*args)
        err = max(rel_error(a, b) for a, b in zip(_flat(out), _flat(ref), strict=True))
        name = ("pre_attention", "post_attention")[which]
        if layer not in regions or not err <= regions[layer][1]:
            regions[layer] = (name, err)
        if which:
            seen[layer] = [out[1], out[0]]

    if isinstance(runner.step, CompiledStep):
        runner.step.observer = observe
    try:
        pages = BlockPool(runner.kv_cache.num_pages).allocate(-(-len(ids) // 16))
        runner.run([Chunk(ids, pages, len(ids))], all_logits=True)
    finally:
        for h in hooks:
            h.remove()
    return [(seen[i][0].float(), seen[i][1].float()) for i in range(len(model.model.layers))], regions


def _flat(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, tuple | list) else (out,)
    return [t for x in items for t in (_flat(x) if isinstance(x, tuple | list) else [x])]


def serving_stage(ctx: DoctorContext, st: StageResult) -> None:
    o = ctx.options
    compiled = o.compile if o.compile is not None else (o.device == "cpu" and compile_available() is None)
    served = _served(ctx)
    ref_model = _reference(ctx)
    dtype = served.dtype
    name = str(dtype).replace("torch.", "")
    path = ServingPath(name, compiled, o.quantization, "native", "kernel")
    tok = ctx.loaded.tokenizer
    a, b = _ids(tok, TEXT, TOKENS_A), _ids(tok, TEXT_B, TOKENS_B)
    quantized = o.quantization != "none"
    limit = threshold(dtype)
    rows: list[list[object]] = []
    first: str | None = None
    for bucket in BUCKETS if compiled else (BUCKETS[-1],):
        ours, regions = _layers(served.model, compiled, a[:bucket])
        refs, _ = _layers(ref_model, False, a[:bucket])
        for i, ((h, mlp), (rh, rmlp)) in enumerate(zip(ours, refs, strict=True)):
            errs = (rel_error(h, rh), rel_error(mlp, rmlp))
            region, region_err = regions.get(i, ("-", 0.0))
            rows.append([bucket, i, errs[0], errs[1], region, region_err])
            for part, err in zip(("attention", "MLP"), errs, strict=True):
                if first is None and not err <= limit and not (quantized and err != float("inf")):
                    where = f" (worst compiled region: {region}, {region_err:.2e} from its eager function)"
                    first = f"bucket {bucket}, layer {i} {part}: error {err:.2e} > {limit:.0e}" + (
                        where if compiled else ""
                    )
    st.table(["bucket", "layer", "attention err", "MLP err", "worst region", "region err"], rows)
    run = run_schedule(served.model, path, a, b)
    ag = compare(run, reference(ref_model, a, b), dtype)
    floor = AGREEMENT[o.quantization]
    st.data = {"path": path.name, "agreement": ag._asdict(), "buckets": sorted(run.buckets), "layers": rows}
    st.note(f"served as {path.name} (dtype {o.serve_dtype}, {'compiled' if compiled else 'eager'}): {ag.describe()}")
    if first is not None:
        st.fail(f"{first} (the first layer past the threshold, against eager float32)")
    if not ag.finite:
        st.fail("non-finite logits on the fixed text")
    elif ag.decided < floor:
        st.fail(f"top-1 agreement with eager float32 {ag.decided:.1%} < {floor:.0%} where float32 decides")
