"""Calibration for int4: what each quantized linear's inputs look like on ordinary text.

int4 at a coarse group (64, 128) loses too much when it rounds every weight alike (the demo
model's top-1 agreement with bf16 falls to 75%). `collect` runs the unquantized model over
`calibration.txt` (prose, dialogue, chat turns, lists, code: ~1.7k tokens, in chunks of 256)
and sums, per linear, `x x^T` over its input columns, kept as the blocks on the diagonal at
the linear's int4 group (`engine/model/int4_calibrated.py` uses them to choose the codes).

A MoE layer's expert stacks: the gate/up stack (`<moe>.w13`) gets the statistics of every
token reaching the layer, not only those routed to each expert; the down stack (`w2`), whose
inputs exist only inside the experts, is quantized without calibration.

The text is not the one `bench/quant_accuracy.py` and the tests measure on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.attention.torch_paged import TorchPagedBackend
from engine.model.int4_calibrated import DAMP, group_blocks
from engine.model.model import CausalLM
from engine.model.moe import SparseMoE
from engine.model.quant import int4_group

log = logging.getLogger("longctx.calibrate")

TEXT_FILE = Path(__file__).with_name("calibration.txt")
CHUNK_TOKENS = 256
PAGE = 16


@dataclass
class Calibration:
    """Per weight name (`<module>.weight`, `<moe>.w13`): the diagonal blocks of `sum x x^T`
    over its input columns, [K/B, B, B] float32, B the weight's int4 group."""

    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    tag: str = ""  # part of the weight fingerprint: which text, how many tokens, which method

    def columns(self, name: str, ranges: tuple[tuple[int, int], ...] | None, group: int) -> torch.Tensor | None:
        """The blocks for the input columns a rank holds (`ranges` of (start, size); None: all),
        at `group` (which divides B): [K_local/group, group, group], or None if not calibrated."""
        h = self.hessians.get(name)
        if h is None:
            return None
        h = group_blocks(h, group)
        if ranges is None:
            return h
        if any(s % group or n % group for s, n in ranges):
            return None
        return torch.cat([h[s // group : (s + n) // group] for s, n in ranges])


def text_ids(tokenizer: object) -> list[int]:
    ids: list[int] = tokenizer.encode(TEXT_FILE.read_text())  # type: ignore[attr-defined]
    return ids


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    n, k = getattr(module, "out_features", None), getattr(module, "in_features", None)
    return (n, k) if isinstance(n, int) and isinstance(k, int) else None


def collect(model: CausalLM, ids: list[int], group_size: int) -> Calibration:
    """Run `model` (unquantized, single process) over `ids` and gather every int4-able linear's
    input statistics."""
    text = xxhash.xxh3_64_hexdigest(TEXT_FILE.read_bytes())
    cal = Calibration(tag=f"calibrated-{text}-{len(ids)}-damp{DAMP}")
    hooks = []

    def add(key: str, module: nn.Module, n: int, k: int) -> None:
        b = int4_group(n, k, group_size)
        if b is None:
            return  # int8 fallback: no groups to calibrate

        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], _out: object) -> None:
            x = args[0].reshape(-1, k).float().view(-1, k // b, b)
            blocks = torch.einsum("tgi,tgj->gij", x, x)
            cal.hessians[key] = cal.hessians[key] + blocks if key in cal.hessians else blocks

        hooks.append(module.register_forward_hook(hook))

    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            w13 = module._parameters.get("w13")
            if w13 is not None:
                add(f"{name}.w13", module, w13.shape[1], w13.shape[2])
        elif (shape := _linear_shape(module)) is not None and name != "lm_head":
            add(f"{name}.weight", module, *shape)
    c = model.config
    dtype = next(model.parameters()).dtype
    device = model.model.norm.weight.device
    pages = CHUNK_TOKENS // PAGE
    caches = [
        torch.zeros(pages, 2, PAGE, model.local_kv_heads, c.head_dim, dtype=dtype, device=device)
        for _ in range(c.num_layers)
    ]
    backend = TorchPagedBackend(model.local_heads, model.local_kv_heads, c.head_dim)
    try:
        with torch.inference_mode():
            for i in range(0, len(ids), CHUNK_TOKENS):
                chunk = ids[i : i + CHUNK_TOKENS]
                if len(chunk) < PAGE:
                    continue
                n = -(-len(chunk) // PAGE)
                meta = AttentionMetadata.build([list(range(n))], [len(chunk)], [len(chunk)], PAGE, device)
                backend.plan(meta)
                model(torch.tensor(chunk, dtype=torch.int64, device=device), meta, caches, backend)
                cal.tokens += len(chunk)
    finally:
        for h in hooks:
            h.remove()
    log.info("int4 calibration: %d linears over %d tokens", len(cal.hessians), cal.tokens)
    return cal
