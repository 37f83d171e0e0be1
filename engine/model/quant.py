"""Weight-only quantized linears: int8 per output channel, int4 per group, on torch's CPU kernels.

Activations stay in the model dtype (bf16, or float32 in tests); only weights are stored
narrow and widened inside the kernel:

- int8: `w ~= q * scale[n]`, q int8 [N, K], one scale per output row (absmax / 127);
  `torch.ops.aten._weight_int8pack_mm(x, q, scale)`.
- int4: per group of `group_size` input columns, `w ~= (q - 8) * scale + zero` with q in
  0..15 (asymmetric: scale and zero per group searched to minimize the reconstruction error,
  `int4_codes`; or a GGUF's Q4_0 / Q4_1 blocks as they are, `Int4Blocks`), packed by
  `_convert_weight_to_int4pack_for_cpu`; `_weight_int4pack_mm_for_cpu(x, packed, g, sz)`
  with sz [K/g, N, 2] (scale, zero) in the activations' dtype.

The int4 kernel needs N % 16 == 0 and K % group == 0; a smaller power-of-two group that
divides K is used when the configured one does not (576 = 9 x 64: the demo model's group 128
becomes 64 for its hidden-size inputs), and int8 when N is not a multiple of 16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import cpu_kernel
from engine.model import int4_calibrated as calib
from engine.model.linear_bf16 import KERNEL_ROWS, bf16_emulated

QUANTIZATIONS = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantConfig:
    mode: str = "none"  # one of QUANTIZATIONS
    group_size: int = 32  # int4 only

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.mode!r}; choose from {', '.join(QUANTIZATIONS)}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, not {self.group_size}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def tag(self) -> str:
        """Part of the weight fingerprint: '' for unquantized weights."""
        return {"none": "", "int8": "int8", "int4": f"int4-g{self.group_size}"}[self.mode]

    @property
    def fingerprint_tag(self) -> str:
        """What the weight fingerprint adds: the tag and, for int4, which quantizer chose the
        codes (KV computed under an older quantizer's weights must not be reused)."""
        return f"{self.tag}/{INT4_QUANTIZER}" if self.mode == "int4" else self.tag


NONE = QuantConfig()

# Names int4's quantizer (`int4_codes`); part of the weight fingerprint.
INT4_QUANTIZER = "search-clip2-lsq3"

# Rows (tokens) from which an int8 product widens its weight and runs a float matmul instead.
DEQUANTIZE_ROWS = 64

# Row chunk for quantizing: bounds the float32 temporaries (the tied head is 49152 rows).
_CHUNK_ROWS = 4096


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> the per-row absmax [N] float32 (the scale is absmax / 127)."""
    return torch.cat([c.float().abs().amax(dim=1) for c in w.split(_CHUNK_ROWS)])


def quantize_int8(
    w: torch.Tensor, absmax: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32, exact in `dtype`). `absmax` [N]: the
    row maxima to scale by (the whole row's, when this rank holds only some of its columns).
    The codes are rounded against the scale as the kernel will see it (rounded to `dtype`)."""
    scale = ((int8_scales(w) if absmax is None else absmax).clamp(min=1e-12) / 127).to(dtype).float()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for i, c in enumerate(w.split(_CHUNK_ROWS)):
        s = scale[i * _CHUNK_ROWS : i * _CHUNK_ROWS + c.shape[0], None]
        q[i * _CHUNK_ROWS : i * _CHUNK_ROWS + c.shape[0]] = (c.float() / s).round_().clamp_(-128, 127)
    return q, scale


def int4_group(n: int, k: int, group_size: int) -> int | None:
    """The group size int4 uses for an [n, k] weight, or None if the kernel cannot take it."""
    if n % 16:
        return None
    g = group_size
    while g >= 32 and k % g:
        g //= 2
    return g if g >= 32 else None


def int4_codes(
    w: torch.Tensor, group: int, dtype: torch.dtype = torch.float32, hessian: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int32 in 0..15, scale_zeros [K/g, N, 2] float32): per group,
    the asymmetric (scale, zero) that most reduces the squared reconstruction error.

    Min/max is the starting point; then a clipping search (the range shrunk towards zero by
    `CLIP_RATIOS`, as AWQ searches its clip) and alternating least squares (codes fixed: the
    best scale and zero in closed form; scale and zero fixed: the nearest codes), keeping per
    group whichever was best. Scale and zero are rounded to `dtype` (the kernel takes them in
    the activations' dtype) before the codes are chosen against them: in bf16, rounding the
    zero after choosing the codes shifts every weight of a group by up to 8 scale ulps.

    hessian: the calibration's diagonal blocks of `sum x x^T` over w's input columns,
    [K/B, B, B] with B a multiple of `group`: the codes are then chosen for the least output
    error instead (`engine/model/int4_calibrated.py`)."""
    N, K = w.shape
    blocks = factors = weights = None
    if hessian is not None:
        blocks = calib.group_blocks(hessian.float(), group)
        factors, weights = calib.inverse_factors(blocks), calib.importance(blocks)
    q = torch.empty(N, K, dtype=torch.int32, device=w.device)
    sz = torch.empty(K // group, N, 2, dtype=torch.float32, device=w.device)
    for i, c in enumerate(w.split(_CHUNK_ROWS)):
        rows = slice(i * _CHUNK_ROWS, i * _CHUNK_ROWS + c.shape[0])
        g = c.float().view(c.shape[0], K // group, group)
        if factors is not None:
            _, scale, zero = _search_int4(g, dtype, weights, calib.CLIPS, calib.ONE_SIDED, calib.ROUNDS)
            codes = calib.compensated_codes(g, scale, zero, factors)
        else:
            codes, scale, zero = _search_int4(g, dtype)
        q[rows] = codes.view(c.shape[0], K).int()
        sz[:, rows, 0] = scale.T
        sz[:, rows, 1] = zero.T
    return q, sz


# `int4_codes`' signature: what a stand-in for it (a cache of codes, `engine/loading/int4_cache.py`)
# takes and returns.
Int4Coder = Callable[[torch.Tensor, int, torch.dtype, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int4 codes 0..15 -> [N, K/2] uint8, two a byte, the even column in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles`' inverse: [N, K/2] uint8 -> [N, K] uint8 codes."""
    return torch.stack((b & 15, b >> 4), dim=-1).view(b.shape[0], -1)


# Range shrink factors tried by the clipping search, and rounds of least-squares refinement.
CLIP_RATIOS = (0.9, 0.8)
LSQ_ROUNDS = 3


# Elements of a weight searched at once: every candidate of the search makes several passes over
# its rows, which stay in a core's cache at this size (0.5 MB of float32) instead of streaming
# from memory (a [1536, 4, 128] weight at one thread: 141 ms whole, 37 ms in 128k-element blocks).
_SEARCH_ELEMENTS = 1 << 17


def _search_int4(
    g: torch.Tensor,
    dtype: torch.dtype,
    importance: torch.Tensor | None = None,
    clips: tuple[float, ...] = CLIP_RATIOS,
    one_sided: tuple[float, ...] = (),
    rounds: int = LSQ_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g [n, G, group] float32 -> (codes [n, G, group] float 0..15, scale [n, G], zero [n, G]).

    importance [G, group]: each column's weight in the error (the calibration's mean squared
    input, `int4_calibrated`); uniform when None. one_sided: shrink factors applied to one end of
    the range only. Each group is searched on its own, so blocks of rows are searched one after
    another (`_SEARCH_ELEMENTS`), with the same result."""
    rows = max(1, _SEARCH_ELEMENTS // max(1, g.shape[1] * g.shape[2]))
    if g.shape[0] <= rows:
        return _search_int4_block(g, dtype, importance, clips, one_sided, rounds)
    codes, scales, zeros = zip(
        *(_search_int4_block(b, dtype, importance, clips, one_sided, rounds) for b in g.split(rows)), strict=True
    )
    return torch.cat(codes), torch.cat(scales), torch.cat(zeros)


def _search_int4_block(
    g: torch.Tensor,
    dtype: torch.dtype,
    importance: torch.Tensor | None,
    clips: tuple[float, ...],
    one_sided: tuple[float, ...],
    rounds: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_search_int4` on rows that fit in cache."""
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [n, G]
    hw = torch.ones(g.shape[1:], dtype=g.dtype, device=g.device) if importance is None else importance

    def fit(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = scale.clamp(min=1e-12).to(dtype).float()
        zero = zero.to(dtype).float()
        codes = ((g - zero[..., None]) / scale[..., None] + 8).round_().clamp_(0, 15)
        err = (((codes - 8) * scale[..., None] + zero[..., None] - g).square_() * hw).sum(dim=-1)
        return codes, scale, zero, err

    def minmax(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = ((hi - lo) / 15).clamp(min=1e-12).to(dtype).float()
        return fit(scale, lo + 8 * scale)

    best = minmax(lo, hi)

    def keep(cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        nonlocal best
        better = cand[3] < best[3]
        best = (
            torch.where(better[..., None], cand[0], best[0]),
            torch.where(better, cand[1], best[1]),
            torch.where(better, cand[2], best[2]),
            torch.where(better, cand[3], best[3]),
        )

    for r in clips:
        keep(minmax(lo * r, hi * r))
    for r in one_sided:
        keep(minmax(lo * r, hi))
        keep(minmax(lo, hi * r))
    total = hw.sum(dim=-1)
    for _ in range(rounds):  # weighted least squares: codes fixed, the best scale and zero
        u = best[0] - 8
        mu, mw = (u * hw).sum(dim=-1) / total, (g * hw).sum(dim=-1) / total
        du = u - mu[..., None]
        var = (du.square() * hw).sum(dim=-1)
        cov = (du * (g - mw[..., None]) * hw).sum(dim=-1)
        scale = torch.where(var > 0, cov / var.clamp(min=1e-12), best[1])
        keep(fit(scale, mw - scale * mu))
    return best[0], best[1], best[2]


@dataclass(frozen=True)
class Int4Blocks:
    """A weight already stored as 4-bit codes per group of 32 inputs (GGUF's Q4_0 / Q4_1 blocks):
    `w = (codes - 8) * scale + zero` (Q4_0: zero 0; Q4_1's `d q + m`: zero = m + 8 d)."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / 32] float32
    zero: torch.Tensor  # [N, K / 32] float32

    GROUP = 32

    def int4(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int32, scale_zeros [K/32, N, 2] float32 rounded to `dtype`), as `int4_codes`."""
        sz = torch.stack((self.scale, self.zero), dim=-1).transpose(0, 1).to(dtype).float()
        return self.codes.int(), sz.contiguous()


# Read once at import: the compiled regions call `dequantized_matmul`, and dynamo cannot trace
# the cached lookup of the CPU's flags.
BF16_EMULATED = bf16_emulated()

# int8 products widen the codes to float32 even where the kernel has AVX512-VNNI (the path of
# AVX-512 CPUs without it; set by `engine.verify.paths.forced` to check that path here).
FORCE_WIDENED = False


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decode-sized int8 products with bf16 activations: `linear_bf16.cpp`'s int8 kernel where
    the CPU has AVX512-VNNI (x's rows quantized to int16, products summed exactly in int32: one
    instruction widens 32 codes, one multiplies and sums them) or emulates bf16 (the codes
    widened to float32 in registers: the demo model's int8 linears in ~0.55x the time there);
    else, and for float32 activations, `_weight_int8pack_mm`."""
    op = cpu_kernel.linear_int8()
    small = x.shape[0] <= KERNEL_ROWS and x.shape[1] % 16 == 0
    fast = BF16_EMULATED or cpu_kernel.int8_vnni()
    if fast and op is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and small:
        return op(x, q, scales, FORCE_WIDENED)
    return torch.ops.aten._weight_int8pack_mm(x, q, scales)


def dequantized_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Prefill-sized int8 products: the int8 kernel is a matrix-vector design (~5x slower than a
    bf16 AMX matmul at 512 rows); widening the weight per call costs far less. In float32 where
    the CPU emulates bf16 (`linear_bf16.py`)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and BF16_EMULATED:
        return F.linear(x.float(), q.float() * scales.float()[:, None]).to(x.dtype)
    return F.linear(x, q.to(x.dtype) * scales[:, None])


def quantized_matmul(x: torch.Tensor, mode: str, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [T, K] @ the quantized weight's transpose -> [T, N] (no bias), as `QuantLinear` and the
    compiled regions compute it: int4 by its kernel, int8 by `int8_matmul` or, prefill-sized,
    `dequantized_matmul`."""
    if mode == "int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, group, scales)
    if x.shape[0] >= DEQUANTIZE_ROWS:
        return dequantized_matmul(x, q, scales)
    return int8_matmul(x, q, scales)


class QuantLinear(nn.Module):
    """`y = x W^T (+ b)` with W int8 or int4; x [..., K] in `dtype` -> [..., N].

    Parameters (no gradients) so weight-byte counts and `.to(device)` see them."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        config: QuantConfig,
        dtype: torch.dtype,
        absmax: torch.Tensor | None = None,
        blocks: Int4Blocks | None = None,
        hessian: torch.Tensor | None = None,
        coder: Int4Coder | None = None,
    ):
        """blocks: the weight's 4-bit codes, taken as they are when int4 runs at their group (32);
        otherwise the float `weight` is quantized, against its calibration `hessian` when given,
        by `coder` (default `int4_codes`)."""
        super().__init__()
        N, K = weight.shape
        self.in_features, self.out_features = K, N
        group = int4_group(N, K, config.group_size) if config.mode == "int4" else None
        if group is not None and absmax is None:
            self.mode, self.group_size = "int4", group
            if blocks is not None and group == Int4Blocks.GROUP:
                q, sz = blocks.int4(dtype)
            else:
                q, sz = (coder or int4_codes)(weight, group, dtype, hessian)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.qweight = nn.Parameter(packed, requires_grad=False)
            self.scales = nn.Parameter(sz.to(dtype), requires_grad=False)
        else:  # int8, and int4's fallback for shapes its kernel cannot take
            self.mode, self.group_size = "int8", 0
            q, scale = quantize_int8(weight, absmax, dtype)
            self.qweight = nn.Parameter(q, requires_grad=False)
            self.scales = nn.Parameter(scale.to(dtype), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = quantized_matmul(x.reshape(-1, shape[-1]), self.mode, self.qweight, self.scales, self.group_size)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        g = f", group={self.group_size}" if self.mode == "int4" else ""
        return f"{self.in_features} -> {self.out_features}, {self.mode}{g}"


class QuantEmbedding(nn.Module):
    """The embedding table of a tied model read from its quantized LM head's rows: ids [T] ->
    [T, hidden] in the head's dtype, dequantized exactly as the head's kernel does.

    int8 shares the head's tensors; int4 keeps the same codes packed row-wise (two per byte,
    low nibble first; the kernel's layout interleaves rows) and shares the head's scales."""

    def __init__(self, head: QuantLinear, weight: torch.Tensor, blocks: Int4Blocks | None = None):
        super().__init__()
        self.head = [head]  # not a submodule: its parameters are counted once, as the head's
        self.num_embeddings, self.embedding_dim = weight.shape
        # A buffer, not a parameter: code that reads the model dtype off its first parameter
        # must not find uint8 here.
        rows = None
        if head.mode == "int4":
            # The head's own codes: its blocks' when it took them, else the same quantization again.
            if blocks is not None and head.group_size == Int4Blocks.GROUP:
                q = blocks.codes.int()
            else:
                q = int4_codes(weight, head.group_size, head.scales.dtype)[0]
            rows = pack_nibbles(q)
        self.rows: torch.Tensor | None
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        if self.rows is None:  # int8: q * scale
            return head.qweight.index_select(0, ids).to(head.scales.dtype) * head.scales.index_select(0, ids)[:, None]
        q = unpack_nibbles(self.rows.index_select(0, ids)).to(head.scales.dtype)  # [T, K]
        sz = head.scales.index_select(1, ids).transpose(0, 1)  # [T, K/g, 2]
        g = head.group_size
        x = (q.view(ids.shape[0], -1, g) - 8) * sz[..., :1] + sz[..., 1:]
        return x.view(ids.shape[0], -1)


def dequantized(layer: QuantLinear) -> torch.Tensor:
    """The weight a QuantLinear computes with, [N, K] float32 (for tests)."""
    if layer.mode == "int8":
        return layer.qweight.float() * layer.scales.float()[:, None]
    eye = torch.eye(layer.in_features, dtype=layer.scales.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, layer.group_size, layer.scales).float().T
