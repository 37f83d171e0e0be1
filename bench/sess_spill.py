"""Part (e) of `bench/sessions.py`: many long conversations interleaved round-robin with a device
KV pool that holds only some of them.

`convs` conversations, each opened by a user message of about `conv_tokens` tokens (round 0: a
full prefill, nothing cached: the baseline), then `rounds` rounds in which every conversation in
turn gets one short question. The device pool holds `device_convs` conversations, the host tier
`host_convs` (fewer than all), and the Redis KV tier the rest; round-robin is the worst order for
an LRU pool, so by its next turn a conversation has left the device pool and the host tier and is
read back from Redis. TTFT per turn is to the first generated delta.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sess_common import client, filler, pct, serve_args, timed

KV_BYTES_PER_TOKEN = {"bfloat16": 23_040, "float32": 46_080}  # demo model: 2 x 30 layers x 3 KV heads x 64
PAGE = 16


def pool_bytes(convs: int, tokens: int, dtype: str) -> int:
    pages = -(-tokens // PAGE) + 1  # a partly filled last page, and one for the turn's new tokens
    return convs * pages * PAGE * KV_BYTES_PER_TOKEN[dtype]


def run_spill(gguf: Path, url: str, logs: Path, a: Any) -> dict[str, Any]:
    from tests.server import start_server

    conv_tokens = a.conv_tokens + (a.rounds + 1) * 48  # the opening message plus each round's turn
    device = pool_bytes(a.device_convs, conv_tokens, a.dtype)
    host = pool_bytes(a.host_convs, conv_tokens, a.dtype if a.spill_kv_dtype == "auto" else "bfloat16") // (
        1 if a.spill_kv_dtype == "auto" else 2
    )
    args = serve_args(a.dtype, a.threads, "--kv-cache-bytes", str(device), "--host-cache-bytes", str(host),
                      "--kv-dtype", a.spill_kv_dtype, "--max-num-batched-tokens", "2048")  # fmt: skip
    server = start_server(gguf, "--redis-url", url, *args, log=logs / "e.log")
    common = {"model": "demo", "temperature": 0, "max_output_tokens": a.spill_output_tokens}
    rows: list[dict[str, Any]] = []
    try:
        c = client(server.url)
        ids = [c.conversations.create(items=[]).id for _ in range(a.convs)]
        for rnd in range(a.rounds + 1):
            for i, conv in enumerate(ids):
                text = filler(i, int(a.conv_tokens * 0.95)) if rnd == 0 else f"Question {rnd}: what came next?"
                r = timed(c, conversation=conv, input=[{"role": "user", "content": text}], **common)
                u = r["response"].usage
                rows.append({"round": rnd, "conv": i, "prompt_tokens": u.input_tokens,
                             "cached_tokens": u.input_tokens_details.cached_tokens, "ttft_s": r["ttft_s"]})  # fmt: skip
            done = [x for x in rows if x["round"] == rnd]
            print(f"round {rnd}: p50 {pct([x['ttft_s'] for x in done], 0.5):.3f} s, "
                  f"p95 {pct([x['ttft_s'] for x in done], 0.95):.3f} s", flush=True)  # fmt: skip
    finally:
        server.stop()
    return {"device_bytes": device, "host_bytes": host, "turns": rows}


def summarize_spill(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for rnd in sorted({x["round"] for x in res["turns"]}):
        xs = [x for x in res["turns"] if x["round"] == rnd]
        t = [x["ttft_s"] for x in xs]
        out.append({"round": rnd, "n": len(xs), "prompt_tokens": round(sum(x["prompt_tokens"] for x in xs) / len(xs)),
                    "cached_frac": sum(x["cached_tokens"] for x in xs) / sum(x["prompt_tokens"] for x in xs),
                    "p50_s": pct(t, 0.5), "p95_s": pct(t, 0.95)})  # fmt: skip
    return out


def print_spill(summary: list[dict[str, Any]]) -> None:
    base = summary[0]["p50_s"]
    print(f"{'round':>5} {'turns':>5} {'prompt':>6} {'cached':>6} {'p50 s':>7} {'p95 s':>7} {'p95/full':>8}")
    for s in summary:
        print(f"{s['round']:>5} {s['n']:>5} {s['prompt_tokens']:>6} {s['cached_frac']:>6.0%} {s['p50_s']:>7.3f} "
              f"{s['p95_s']:>7.3f} {s['p95_s'] / base:>8.2f}")  # fmt: skip
    print("round 0 is the full prefill of each opening message (p95/full: against its p50)")
