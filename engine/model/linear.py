"""Linear layers with weights prepacked for oneDNN (bfloat16 on CPU), computed in float32
(bfloat16 on CPUs that emulate it, `linear_bf16.py`) or quantized (`quant.py`), and the
conversion of a loaded model's linears, MoE experts and tied LM head to them.

torch's `F.linear` on CPU reorders a bf16 weight into oneDNN's blocked layout on every call;
for the small-batch matmuls of decoding that reorder costs as much as the product itself.
Packing each weight once after loading (what inductor's freezing does) removes it. The
packed tensor holds the same bytes; results equal `F.linear`'s (the same kernel runs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.model.head import FloatHead
from engine.model.linear_bf16 import WidenedLinear, bf16_emulated
from engine.model.moe import SparseMoE
from engine.model.quant import NONE, Int4Blocks, Int4Coder, QuantConfig, QuantEmbedding, QuantLinear

log = logging.getLogger("longctx.linear")


@functools.cache
def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


class PackedLinear(nn.Module):
    """`y = x W^T (+ b)` with W prepacked; x [..., in] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight [out, in] bf16, bias [out] or None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)


# Linears that stay in the model dtype under quantization: MoE routers (an int8 router can
# change which experts a token goes to) and Qwen2-MoE's one-row shared-expert gate.
UNQUANTIZED_SUFFIXES = (".mlp.gate", ".shared_expert_gate")


def head_quant(quant: QuantConfig) -> QuantConfig:
    """The LM head stays int8 under int4, as llama.cpp keeps its output tensor at 6+ bits: at 4
    bits its rounding moves the demo model's top-1 token at ~1 position in 6 (the embedding,
    read from the head's rows when tied, follows it)."""
    return QuantConfig("int8") if quant.mode == "int4" else quant


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quant: QuantConfig,
    absmax: torch.Tensor | None = None,
    blocks: Int4Blocks | None = None,
    hessian: torch.Tensor | None = None,
    coder: Int4Coder | None = None,
) -> nn.Module | None:
    """The fast module for `y = x W^T + b` (weight [out, in]): quantized, bf16 computed in
    float32 where the CPU emulates bf16 (`linear_bf16.py`), prepacked bf16, or None when plain
    `F.linear` is as good (float32, or no oneDNN). blocks: the weight's own 4-bit
    codes (a GGUF's Q4_0 / Q4_1), which int4 at group 32 takes as they are. hessian: int4's
    calibration statistics for the weight's input columns (`engine/loading/calibrate.py`). coder:
    what chooses int4 codes (default `int4_codes`; a cache of them, `engine/loading/int4_cache.py`)."""
    if quant.enabled:
        return QuantLinear(weight, bias, quant, weight.dtype, absmax, blocks, hessian, coder)
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and bf16_emulated():
        return WidenedLinear(weight, bias)
    if packing_supported(weight.dtype, weight.device):
        return PackedLinear(weight, bias)
    return None


def convert_module(
    model: nn.Module,
    name: str,
    quant: QuantConfig = NONE,
    absmax: dict[str, torch.Tensor] | None = None,
    blocks: Int4Blocks | None = None,
    hessians: Callable[[str, int, int], torch.Tensor | None] | None = None,
    coder: Int4Coder | None = None,
) -> bool:
    """Replace the loaded `nn.Linear` at `name` (or the expert stacks of the `SparseMoE` there)
    by packed or quantized modules, dropping the float weights. Returns whether anything changed.

    absmax: per parameter name (`<name>.weight`, `<name>.w2`), the int8 row maxima over the whole
    checkpoint row, for ranks that hold only some of a row's columns. blocks: a linear's weight as
    4-bit codes (`make_linear`). hessians: (parameter name, rows, columns held) -> int4's
    calibration statistics for those columns at the weight's int4 group, or None. coder: as
    `make_linear`'s."""
    absmax = absmax or {}

    def hessian(pname: str, n: int, k: int) -> torch.Tensor | None:
        return hessians(pname, n, k) if hessians is not None and quant.mode == "int4" else None

    module = model.get_submodule(name)
    if isinstance(module, nn.Linear) and name == "lm_head":
        new = make_head(module.weight.detach(), quant, absmax.get(f"{name}.weight"))
    elif isinstance(module, nn.Linear):
        q = NONE if name.endswith(UNQUANTIZED_SUFFIXES) else quant
        new = make_linear(
            module.weight.detach(),
            None if module.bias is None else module.bias.detach(),
            q,
            absmax.get(f"{name}.weight"),
            blocks,
            hessian(f"{name}.weight", *module.weight.shape) if q.mode == "int4" else None,
            coder,
        )
    if isinstance(module, nn.Linear):
        if new is None:
            return False
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
        return True
    if isinstance(module, SparseMoE):
        changed = False
        for attr in ("w13", "w2"):
            stack = module._parameters.get(attr)
            if stack is None:
                continue
            amax = absmax.get(f"{name}.{attr}")
            h = hessian(f"{name}.{attr}", *stack.shape[1:])
            layers = [
                make_linear(stack[e].detach(), None, quant, None if amax is None else amax[e], hessian=h, coder=coder)
                for e in range(stack.shape[0])
            ]
            if any(x is None for x in layers):
                continue
            module.register_parameter(attr, None)
            setattr(module, f"{attr}_linears", nn.ModuleList(x for x in layers if x is not None))
            changed = True
        return changed
    return False


def make_head(
    weight: torch.Tensor, quant: QuantConfig, absmax: torch.Tensor | None = None, blocks: Int4Blocks | None = None
) -> nn.Module | None:
    """The LM head for weight [V, hidden]: an int8 `QuantLinear` under quantization (`head_quant`),
    a `FloatHead` for half-precision weights (float32 logits from the weights as they are, never
    prepacked), or None for float32 weights (plain `F.linear` is float32 already)."""
    q = head_quant(quant)
    if q.enabled:
        return QuantLinear(weight, None, q, weight.dtype, absmax, blocks)
    return None if weight.dtype == torch.float32 else FloatHead(weight)


def convert_tied_head(model: nn.Module, quant: QuantConfig = NONE, blocks: Int4Blocks | None = None) -> bool:
    """Give a tied model (`model.tied_head`) its LM head as a module of its own (`make_head`),
    from the embedding table. Quantized, the embedding is then read back from the head's
    quantized rows, so the float table is dropped (single process only); unquantized, the head
    shares the table's storage. A first pipeline stage without the head quantizes its table the
    same way, so its embeddings are the rows one process reads (the last stage's head is built
    from the same tensor)."""
    embed = model.model.embed_tokens  # type: ignore[union-attr]
    parallel = model.parallel  # type: ignore[union-attr]
    if model.lm_head is not None or not model.config.tie_word_embeddings:  # type: ignore[union-attr]
        return False  # an LM head of its own
    if not parallel.last_stage and not (parallel.first_stage and quant.enabled):
        return False  # (pipeline parallel) neither the head nor a table read back from it on this stage
    head = make_head(embed.weight.detach(), quant, blocks=blocks)
    if head is None:
        return False
    if parallel.last_stage:
        model.tied_head = head
    elif not isinstance(head, QuantLinear):
        return False
    if isinstance(head, QuantLinear):
        table = QuantEmbedding(head, embed.weight.detach(), blocks)
        if type(embed) is nn.Embedding:
            model.model.embed_tokens = table  # type: ignore[union-attr]
        else:  # vocabulary-parallel: keeps its float table, holding the same dequantized rows
            with torch.no_grad():
                embed.weight.copy_(table(torch.arange(embed.weight.shape[0], device=embed.weight.device)))
    return True


def convert_all(model: nn.Module, quant: QuantConfig = NONE) -> int:
    """Convert every linear, MoE expert stack and the tied head of a loaded model (the loader
    converts while streaming instead; this is for models loaded whole). Returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, (nn.Linear, SparseMoE)):
            count += convert_module(model, name, quant)
    count += convert_tied_head(model, quant)
    log.debug("converted %d linear layers (%s)", count, quant.mode)
    return count
