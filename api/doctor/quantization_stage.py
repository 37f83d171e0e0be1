"""Stage 8, quantization: which layers can go to low bits.

Each layer group (attention projections, MLP / MoE experts, LM head) is quantized alone, int8
per channel and int4 per group, on a copy of the loaded float model; the fixed prompts run
through it and its logits are compared with the unquantized model's: relative error and top-1
agreement over every prompt position. The numbers are a guide (report only); a non-finite
logit fails, and int8 of one group moving top-1 at more than 10% of positions warns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from api.doctor.capture import capture_ours, rel_error
from api.doctor.context import DoctorContext
from api.doctor.report import StageResult
from engine.model.linear import convert_module, convert_tied_head, head_quant
from engine.model.model import CausalLM
from engine.model.moe import SparseMoE
from engine.model.quant import QuantConfig

MODES = (QuantConfig("int8"), QuantConfig("int4", 32))
INT8_MIN_AGREEMENT = 0.90

GROUPS: dict[str, Callable[[str], bool]] = {
    "attention": lambda name: ".self_attn." in name,
    "MLP": lambda name: ".mlp" in name,
    "LM head": lambda name: name == "lm_head",
}


def _quantize_group(model: CausalLM, group: str, quant: QuantConfig) -> int:
    """Quantize this group's linears (and expert stacks) in place; returns how many changed."""
    wanted = GROUPS[group]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | SparseMoE) and wanted(n)]
    changed = sum(convert_module(model, n, quant) for n in names)
    if group == "LM head" and model.lm_head is None:
        changed += convert_tied_head(model, quant)
    return changed


def quantization_stage(ctx: DoctorContext, st: StageResult) -> None:
    model = ctx.loaded.model
    if next(model.parameters()).device.type != "cpu":
        st.skip("the int8/int4 kernels are CPU ones: run the doctor with --device cpu")
        return
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        st.skip("the loaded linears are prepacked: run the doctor with --dtype float32")
        return
    base = torch.cat([c.logits for c in ctx.ours])  # [T, V]
    top1 = base.argmax(-1)
    rows: list[list[object]] = []
    for quant in MODES:
        for group in GROUPS:
            if group == "LM head" and head_quant(quant) != quant:
                continue  # the server keeps an int4 model's head int8 (`head_quant`): nothing new to measure
            q = copy.deepcopy(model)
            if not _quantize_group(q, group, quant):
                continue
            logits = torch.cat([c.logits for c in capture_ours(q, ctx.prompts)])
            agree = float((logits.argmax(-1) == top1).float().mean())
            err = rel_error(logits, base)
            rows.append([group, quant.tag, err, f"{agree:.1%}"])
            st.data[f"{group}/{quant.tag}"] = {"logit_error": err, "top1_agreement": agree}
            if not bool(torch.isfinite(logits).all()):
                st.fail(f"{group} under {quant.tag}: non-finite logits")
            elif quant.mode == "int8" and agree < INT8_MIN_AGREEMENT:
                st.warn(f"{group} under int8 moves top-1 at {1 - agree:.0%} of positions")
    st.table(["group", "quantization", "logit error", "top-1 agreement"], rows)
    st.note("each group quantized alone (the others unquantized); under int4 the LM head stays int8; report only")
