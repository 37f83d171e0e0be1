"""Peak memory of one prefill chunk against a long cached context, by attention path.

One process per measurement (its peak RSS is its own): a layer's cache of `--context` tokens
of random bf16 K/V (tiny model shape: 4 query heads, 2 KV heads of 16), then one chunk of
`--chunk` new tokens at its end through the torch_paged backend, taking `--path`:

- split: full attention split at the cached prefix, merged by log-sum-exp (the default on CPU);
- blocked: masked query blocks of at most `MASK_BUDGET` mask elements (windows, other devices);
- dense: one [chunk, context] boolean mask and one SDPA call, as before (for comparison).

Prints JSON: peak RSS growth during the call over the cache's, the dense mask's size, time.

    python bench/long_context_memory.py --context 262144 --chunk 2048 --path split
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, KVH, D, PAGE = 4, 2, 16, 16


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=1 << 18)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--path", choices=("split", "blocked", "dense"), default="split")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    from engine.attention import torch_paged
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_paged import TorchPagedBackend

    torch.set_num_threads(1)
    L, n = args.context, args.chunk
    pages = -(-L // PAGE)
    cache = torch.randn(pages, 2, PAGE, KVH, D).to(torch.bfloat16)
    q, k, v = (torch.randn(n, h, D).to(torch.bfloat16) for h in (H, KVH, KVH))
    table = list(range(pages))
    backend = TorchPagedBackend(H, KVH, D)
    backend.plan(AttentionMetadata.build([table], [n], [L], PAGE))
    if args.path == "blocked":
        torch_paged.has_lse_attention = lambda device: False  # type: ignore[assignment]
    # The gathered K/V are part of every path: read once before measuring.
    keys = cache[:, 0].reshape(-1, KVH, D)[:L].transpose(0, 1)[None]
    values = cache[:, 1].reshape(-1, KVH, D)[:L].transpose(0, 1)[None]
    base = peak_mb()
    t0 = time.perf_counter()
    if args.path == "dense":
        q_pos = torch.arange(L - n, L)[:, None]
        mask = torch.arange(L)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=D**-0.5, enable_gqa=True
        )
    else:
        del keys, values
        out = backend.forward(0, q, k, v, cache, None)
    seconds = time.perf_counter() - t0
    assert torch.isfinite(out).all()
    print(
        json.dumps(
            {
                "path": args.path,
                "context": L,
                "chunk": n,
                "peak_growth_mb": peak_mb() - base,
                "dense_mask_mb": n * L / 2**20,
                "seconds": seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
