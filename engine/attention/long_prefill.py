"""Attention of a prefill chunk against a long cached context without an O(chunk x context) mask.

A chunk of q new tokens after c cached ones attends to c + q keys. A boolean mask for it is
[q, c + q]: at a 1M-token context and a 2k chunk that is 2 GB per call. Two ways around it:

- Full attention (`attend_after_prefix`): every cached key is visible to every query, so the
  chunk's output is the merge of two masks-free attentions: its queries against the c cached
  keys (no mask) and against its own q keys (plain causal: a square block). Each returns the
  log-sum-exp of its scores; the merge weighs the two outputs by them, in float32. The grouped
  query heads are folded into the query length for the prefix call (a KV head's G query heads
  become G*q rows), so K/V are never repeated per head. Needs torch's CPU flash-attention op,
  which returns the log-sum-exp (`has_lse_attention`).
- Otherwise (`attend_blocked`): queries in blocks, each block with its own mask over just the
  keys it can see, the block size chosen so that a mask stays under `MASK_BUDGET` elements.
  Sliding-window layers (the keys a block sees are bounded by window + block) and
  full-attention layers on devices without that op take this path.

Both accumulate softmax max and sum in float32 for bf16 inputs (the flash kernels do); the
prefix split also takes its inputs in float32 (see `attend_after_prefix`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MASK_BUDGET = 1 << 24  # elements of one boolean mask (16 MB)
_LSE_OP = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def has_lse_attention(device: torch.device) -> bool:
    return device.type == "cpu" and _LSE_OP is not None


def attend_after_prefix(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """Causal attention of the last q = L - prefix positions over all L keys.

    Args: queries [H, q, D]; keys, values [KVH, L, D] (views are fine); prefix = L - q >= 1.
    Returns [H, q, D] in the queries' dtype."""
    assert _LSE_OP is not None
    H, q, D = queries.shape
    KVH, L, _ = keys.shape
    G = H // KVH
    assert L - prefix == q and prefix > 0, (L, prefix, q)
    out_dtype = queries.dtype
    if out_dtype != torch.float32:
        # Both halves run on float32 inputs: with bf16 inputs the two partial outputs merged here
        # left the tiny Mixtral's chunked-prefill logits 6x further from float32 (rel. error 0.049
        # against 0.008 for masked attention); with float32 inputs it is 0.007. The cost is a
        # float32 copy of the keys and values read, beside the copy the gather already made.
        queries, keys, values = queries.float(), keys.float(), values.float()
    # Prefix: no mask; a KV head's G query heads folded into rows (heads h = kvh * G + g).
    folded = queries.reshape(1, KVH, G * q, D)
    o1, lse1 = _LSE_OP(folded, keys[None, :, :prefix], values[None, :, :prefix], 0.0, False, scale=scale)
    o1, lse1 = o1.reshape(H, q, D), lse1.reshape(H, q)
    # The chunk's own keys: a square causal block; K/V repeated over the G heads (q rows only).
    tail_k = keys[:, prefix:].repeat_interleave(G, dim=0)
    tail_v = values[:, prefix:].repeat_interleave(G, dim=0)
    o2, lse2 = _LSE_OP(queries[None], tail_k[None], tail_v[None], 0.0, True, scale=scale)
    o2, lse2 = o2[0], lse2[0]
    w1 = torch.sigmoid(lse1 - lse2)[..., None]  # exp(lse1) / (exp(lse1) + exp(lse2)), float32
    out = o2.float().lerp_(o1.float(), w1)
    return out.to(out_dtype)


# One decoding sequence's keys are split into SPLITS parts from this many keys on.
SPLIT_FROM = 1024
SPLITS = 4


def split_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head over many keys, the keys split into `SPLITS` parts run as a batch of
    the flash kernel and merged by their log-sum-exps (flash decoding). The CPU kernel
    parallelizes over batch x heads only: one sequence's 3 KV heads kept one of two threads
    idle, and its G-row query blocks made each key block cost as much as a prefill's.
    Measured per layer on the demo model's shapes (bf16, 2 threads), gather + attention:
    0.30 -> 0.23 ms at 2k keys, 0.56 -> 0.40 ms at 4k, 1.12 -> 0.94 ms at 8k.

    Args: q [1, H, D]; keys, values [1, KVH, L, D] (views are fine). Returns [1, H, D]."""
    assert _LSE_OP is not None
    _, H, D = q.shape
    _, KVH, L, _ = keys.shape
    G = H // KVH
    n = SPLITS
    chunk = L // n
    main = n * chunk

    def parts(x: torch.Tensor) -> torch.Tensor:  # [1, KVH, L, D] -> [n, KVH, chunk, D] (a view)
        return x[0, :, :main].unflatten(1, (n, chunk)).transpose(0, 1)

    folded = q.reshape(1, KVH, G, D)
    o, lse = _LSE_OP(folded.expand(n, KVH, G, D), parts(keys), parts(values), 0.0, False, scale=scale)[:2]
    outs, lses = [o.float()], [lse]
    if main < L:  # the last L % n keys
        o2, lse2 = _LSE_OP(folded, keys[:, :, main:], values[:, :, main:], 0.0, False, scale=scale)[:2]
        outs.append(o2.float())
        lses.append(lse2)
    weights = torch.softmax(torch.cat(lses), dim=0)[..., None]  # [parts, KVH, G, 1]
    out = (torch.cat(outs) * weights).sum(dim=0)  # [KVH, G, D]
    return out.reshape(1, H, D).to(q.dtype)


def attend_blocked(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_pos0: int,
    k_pos0: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Causal (optionally windowed) attention with bounded masks.

    Args: queries [H, q, D] at positions q_pos0 .. q_pos0 + q - 1; keys, values [KVH, L, D] at
    positions k_pos0 .. k_pos0 + L - 1 (covering every key any query sees); window in tokens
    (a query at p sees p - window + 1 .. p) or None. Returns [H, q, D]."""
    q = queries.shape[1]
    L = keys.shape[1]
    device = queries.device
    span = L if window is None else min(L, window)  # keys one query can see, at most
    block = max(1, min(q, MASK_BUDGET // (span + q)))
    out = torch.empty_like(queries)
    for a in range(0, q, block):
        b = min(q, a + block)
        first = 0 if window is None else max(0, q_pos0 + a - window + 1 - k_pos0)
        last = q_pos0 + b - k_pos0  # exclusive: keys up to the block's last query
        q_pos = torch.arange(q_pos0 + a, q_pos0 + b, device=device)[:, None]
        kv_pos = torch.arange(k_pos0 + first, k_pos0 + last, device=device)[None, :]
        mask = kv_pos <= q_pos
        if window is not None:
            mask &= kv_pos > q_pos - window
        out[:, a:b] = F.scaled_dot_product_attention(
            queries[None, :, a:b],
            keys[None, :, first:last],
            values[None, :, first:last],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )[0]
    return out
