"""Time to first token with and without the KV store, and what a page costs in Redis.

For each prompt length: (a) full prefill, (b) a prefix hit in the device pool (same engine,
second time), (c) a fresh process (model loaded and warmed up with one short unrelated prompt, empty device
and host tiers) restoring the prompt's pages from Redis; model load time is reported apart. For each KV storage dtype
(model dtype, int8): bytes per token stored (payload length) next to the theoretical
2 x layers x kv_heads x head_dim x bytes, and Redis `used_memory` growth per token.
Uses a private redis-server (allkeys-lru) in a temporary directory. Prints a table and
writes JSON to bench/results/resume.json.

    python bench/resume.py [--lengths 1024,4096,7680] [--long 16384] [--kv-dtypes auto,int8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def _prompt(n: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _ttft(engine: Any, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, next token)."""
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    h = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    engine.run_until_idle()
    outs = list(h)
    return time.perf_counter() - t0, outs[-1].cached_tokens, outs[0].token_ids[0] if outs[0].token_ids else -1


def load_any(model: str) -> Any:
    """The demo model through `engine.loading.loader.load`; a random checkpoint directory (no
    tokenizer) through `engine.loading.weights.load_model`, in bfloat16."""
    from engine.loading.loader import load

    if not Path(model).is_dir():
        return load(model, progress=False)
    from types import SimpleNamespace

    import torch

    from engine.loading.weights import SafetensorsSource, load_model
    from engine.model.config import ModelConfig

    config = ModelConfig.from_pretrained_dir(Path(model))
    net, stats = load_model(config, SafetensorsSource(Path(model)), torch.bfloat16, progress=False)
    return SimpleNamespace(config=config, model=net, tokenizer=None, dtype=torch.bfloat16, stats=stats)


def _engine(lm: Any, length: int, **kw: Any) -> Any:
    from engine.engine import Engine, EngineConfig

    c = lm.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * lm.dtype.itemsize
    cfg = EngineConfig(kv_cache_bytes=(length + 64) * per_token, max_num_batched_tokens=2048, **kw)
    return Engine(lm.model, lm.tokenizer, cfg, fingerprint=lm.stats.fingerprint)


def random_demo_shape(max_positions: int, directory: Path) -> Path:
    """A random model of the demo's shape (SmolLM2-135M) with `max_positions` positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=max_positions, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip
    LlamaForCausalLM(cfg).bfloat16().save_pretrained(directory)
    return directory


def measure_writer(model: str, lengths: list[int], kv_dtypes: list[str], url: str) -> dict[str, Any]:
    """(a) and (b) for each length; pages written to Redis in each KV dtype, with their size."""
    import redis

    from kvstore.codec import PageCodec
    from kvstore.prefix import Namespace, page_hashes
    from kvstore.redis_tier import RedisTier

    lm = load_any(model)
    c = lm.config
    admin = redis.Redis.from_url(url)
    out: dict[str, Any] = {"load_s": lm.stats.seconds, "dtype": str(lm.dtype).replace("torch.", ""), "lengths": {}}
    for n in lengths:
        prompt = _prompt(n, c.vocab_size)
        e = _engine(lm, n)
        full_s, _, tok_full = _ttft(e, prompt)
        hit_s, cached, tok_hit = _ttft(e, prompt)
        row: dict[str, Any] = {"full_s": full_s, "hit_s": hit_s, "hit_cached": cached, "token": tok_full}
        row["hit_same_token"] = tok_hit == tok_full
        full_pages = n // 16
        for kv_dtype in kv_dtypes:
            ns = Namespace(c.architecture, lm.stats.fingerprint, out["dtype"], _kvd(kv_dtype, out["dtype"]), 16)
            codec = PageCodec(e.kv_spec, ns.kv_dtype, ns.key)
            tier = RedisTier(url, codec, prefix="kv")
            hashes = page_hashes(prompt, 16, ns.salted(""))
            own = page_hashes(prompt, 16, e.namespace.salted(""))
            pages = [e.pool.cached[h] for h in own[:full_pages]]  # the pages computed by (a)
            before = int(admin.info("memory")["used_memory"])
            t0 = time.perf_counter()
            for start in range(0, full_pages, 64):
                tier.save(hashes[start : start + 64], e.kv_cache.read_pages(pages[start : start + 64]))
            tier.flush(600)
            write_s = time.perf_counter() - t0
            grown = int(admin.info("memory")["used_memory"]) - before
            row[kv_dtype] = {
                "pages": tier.counters.written,
                "write_s": write_s,
                "payload_bytes_per_token": codec.payload_len / 16,
                "theoretical_bytes_per_token": e.kv_spec.bytes_per_token * (0.5 if ns.kv_dtype == "int8" else 1.0),
                "redis_bytes_per_token": grown / max(1, tier.counters.written * 16),
            }
            tier.close()
        out["lengths"][str(n)] = row
        print(f"  {model} {n}: full {full_s:.2f} s, hit {hit_s:.3f} s", flush=True)
    return out


def _kvd(kv_dtype: str, model_dtype: str) -> str:
    return model_dtype if kv_dtype == "auto" else kv_dtype


RESTORE = """
import json, sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
from bench.resume import _engine, _prompt, _ttft, load_any
lm = load_any({model!r})
out = {{"load_s": time.perf_counter() - t0, "lengths": {{}}}}
t0 = time.perf_counter()
_ttft(_engine(lm, 64), _prompt(48, lm.config.vocab_size))  # warm-up, as a server does once at start
out["warmup_s"] = time.perf_counter() - t0
for n in {lengths!r}:
    e = _engine(lm, n, kv_redis_url={url!r}, kv_dtype={kv_dtype!r}, kv_lookup_timeout_s=5.0)
    s, cached, tok = _ttft(e, _prompt(n, lm.config.vocab_size))
    out["lengths"][str(n)] = {{"restore_s": s, "cached": cached, "token": tok, "kv": e.kv_stats()}}
    e.shutdown()
print("RESULT " + json.dumps(out))
"""


def measure_restore(model: str, lengths: list[int], kv_dtype: str, url: str) -> dict[str, Any]:
    code = RESTORE.format(root=str(ROOT), model=model, lengths=lengths, url=url, kv_dtype=kv_dtype)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def run_model(model: str, lengths: list[int], kv_dtypes: list[str], url: str) -> dict[str, Any]:
    result = measure_writer(model, lengths, kv_dtypes, url)
    result["restore"] = {d: measure_restore(model, lengths, d, url) for d in kv_dtypes}
    return result


def table(results: dict[str, Any]) -> str:
    head = "| model | tokens | (a) full s | (b) device hit s | b/a | KV dtype | (c) Redis restore s | c/a | "
    head += "pages from Redis | payload B/token | theoretical | Redis used_memory B/token | model load s |"
    lines = [head, "|" + "---|" * 13]
    for name, r in results.items():
        for n, row in r["lengths"].items():
            for d, rest in r["restore"].items():
                c = rest["lengths"][n]
                size = row[d]
                mark = "" if c["token"] == row["token"] else " (token differs)"
                lines.append(
                    f"| {name} | {n} | {row['full_s']:.2f} | {row['hit_s']:.3f} | {row['hit_s'] / row['full_s']:.3f} "
                    f"| {_kvd(d, r['dtype'])} | {c['restore_s']:.3f} | {c['restore_s'] / row['full_s']:.3f} "
                    f"| {c['kv'].get('redis', {}).get('loaded', 0)}/{int(n) // 16}{mark} "
                    f"| {size['payload_bytes_per_token']:.0f} | {size['theoretical_bytes_per_token']:.0f} "
                    f"| {size['redis_bytes_per_token']:.0f} | {rest['load_s']:.1f} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,7680", help="demo-model prompt lengths")
    ap.add_argument("--long", type=int, default=16384, help="length on a random 32k-position model (0 = skip)")
    ap.add_argument("--kv-dtypes", default="auto,int8")
    ap.add_argument("--out", default=str(RESULTS / "resume.json"))
    args = ap.parse_args()
    from engine.loading.model_source import pull_demo
    from tests.redis_server import private_redis

    kv_dtypes = args.kv_dtypes.split(",")
    results: dict[str, Any] = {}
    with private_redis("--maxmemory", "8gb", "--maxmemory-policy", "allkeys-lru") as url:
        lengths = [int(x) for x in args.lengths.split(",") if x]
        if lengths:
            results["demo"] = run_model(str(pull_demo()), lengths, kv_dtypes, url)
        if args.long:
            with tempfile.TemporaryDirectory() as tmp:
                path = random_demo_shape(32768, Path(tmp) / "random-32k")
                results["random-32k"] = run_model(str(path), [args.long], kv_dtypes, url)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
