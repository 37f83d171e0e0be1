"""Two long conversations taking turns through a device pool that holds one of them, with the
host tier below it: every turn restores its conversation's history from the host tier and
evicts the other's. Side by side in one run, the host tier as it is (a page it holds already is
only made most recently used when evicted again) and copying every evicted page (what it did
before: a put of a fresh copy over the same payload). Per mode: the TTFT of the turns after the
first two (p50 / p95), the pages the host tier copied in and kept, the bytes copied, and whether
the two modes' greedy outputs agree.

    python bench/host_cycle.py [--tokens 2048] [--turns 12] [--new-tokens 32]

Prints a table and writes JSON to bench/results/host_cycle.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from bench.pressure import PAGE, Runner, _pct, _tokens  # noqa: E402


def run(lm: Any, a: Any, copy_always: bool) -> dict[str, Any]:
    """Both conversations' turns, alternating; `copy_always`: every evicted page copied again."""
    from kvstore.tiers import HostTier

    keep = HostTier.keep
    if copy_always:
        HostTier.keep = lambda self, page_hashes: [False] * len(page_hashes)  # type: ignore[method-assign]
    vocab = lm.config.vocab_size
    pool = a.tokens // PAGE + a.turns * (a.new_tokens + a.output_tokens) // PAGE + 8  # one conversation
    host = 4 * pool  # both conversations, with room
    runner = Runner(lm, pool, host, None, a)
    try:
        convs = [_tokens(1000 + i, a.tokens, vocab) for i in range(2)]
        ttfts, cached, outputs = [], [], []
        t0 = time.perf_counter()
        for turn in range(a.turns):
            i = turn % 2
            res = runner.turn([convs[i]], a.output_tokens)[0]
            if turn >= 2:
                ttfts.append(res["ttft_s"])
                cached.append(res["cached"] / len(convs[i]))
            outputs.append(res["ids"])
            convs[i] = convs[i] + res["ids"] + _tokens(7 * turn + i, a.new_tokens, vocab)
        wall = time.perf_counter() - t0
        store = runner.engine.store
        assert store is not None
        c = store.host.counters
        page_bytes = store.kv_cache.spec.bytes_per_page
        return {"copy_always": copy_always, "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p95_s": _pct(ttfts, 0.95),
                "min_cached": min(cached), "stored": c.stored, "kept": c.kept, "hits": c.hits,
                "bytes_copied": c.stored * page_bytes, "wall_s": wall, "outputs": outputs}  # fmt: skip
    finally:
        runner.close()
        HostTier.keep = keep  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=2048, help="each conversation's first prompt")
    p.add_argument("--turns", type=int, default=12, help="turns in all, alternating between the two")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default=str(RESULTS / "host_cycle.json"))
    a = p.parse_args()

    from engine.loading.loader import load
    from engine.loading.model_source import pull_demo

    lm = load(a.model or str(pull_demo()), dtype=a.dtype, progress=False)
    runs = [run(lm, a, copy_always=mode) for _ in range(a.rounds) for mode in (True, False)]
    agree = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    print(f"\ntwo conversations of {a.tokens} tokens taking {a.turns} turns (+{a.new_tokens} tokens each) "
          f"through a pool that holds one; {lm.dtype}; outputs agree: {agree}")  # fmt: skip
    print("evicted pages     TTFT p50 / p95 (ms)   min cached   pages copied / kept   MB copied   wall s")
    for r in runs:
        print(
            f"{'copied again' if r['copy_always'] else 'kept if held':14s}  {r['ttft_p50_s'] * 1000:7.1f} / "
            f"{r['ttft_p95_s'] * 1000:7.1f}   {r['min_cached'] * 100:8.1f}%   {r['stored']:8d} / {r['kept']:5d}"
            f"   {r['bytes_copied'] / 1e6:9.1f}   {r['wall_s']:6.1f}"
        )
    for r in runs:
        del r["outputs"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "dtype": str(lm.dtype), "outputs_agree": agree, "runs": runs},
                                      indent=1))  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
