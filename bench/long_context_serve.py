"""A million-token conversation through the API: `longctx serve`, many turns, a restart.

A tiny random Mistral with a sliding window on every layer (bf16, 256 B of KV per token) and
the demo model's tokenizer, saved as a safetensors directory and served with `longctx serve
--model DIR --no-compile` (state and KV pages in the shared test Redis under a fresh prefix,
deleted afterwards). One conversation grows by `responses.create` turns, each adding one large
`input_text` item (about `--turn-tokens` tokens of random words) with `max_output_tokens` small,
until `--tokens` of context. Then the server is stopped and started again on the same Redis
(`--kv-redis-url` the same), and one more turn is sent: its `cached_tokens` must cover the
window (only the pages inside it are fetched from Redis: resume at the tail), and the
conversation's stored items must be intact (count and bytes, before and after).

Per turn: input tokens, cached tokens, wall time. Run by `bench/long_context.py --serve` (printed
with the rest) or alone:

    python bench/long_context_serve.py [--tokens 1048576] [--turn-tokens 32768]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WINDOW, PAGE, CHUNK = 4096, 16, 4096
REDIS_URL = "redis://127.0.0.1:6379/15"


def windowed_model_dir(path: Path, max_len: int) -> Path:
    """A tiny random windowed Mistral with the demo tokenizer (its vocabulary and chat template)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from engine.loading.gguf_cache import GGUFCache
    from engine.loading.loader import load_tokenizer
    from engine.loading.model_source import pull_demo, resolve_model

    torch.manual_seed(0)
    config = MistralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=49152, max_position_embeddings=max_len, sliding_window=WINDOW, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    MistralForCausalLM(config).save_pretrained(path)
    demo = pull_demo()
    load_tokenizer(resolve_model(str(demo)), (), GGUFCache(demo)).hf.save_pretrained(path)
    return path


def words_text(rng: random.Random, n_words: int) -> str:
    """Random lower-case words (about 2.7 tokens each with the demo tokenizer)."""
    letters = "etaoinshrdlucmfwypvbgk"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(n_words))


def stored_items(client: Any, conv_id: str) -> tuple[int, int]:
    """(count, bytes of their JSON) of a conversation's items, every page of them."""
    count = size = 0
    for item in client.conversations.items.list(conv_id, limit=100, order="asc"):
        count += 1
        size += len(json.dumps(item.model_dump(mode="json", exclude={"id"}), sort_keys=True))
    return count, size


def serve_args(model: Path, max_len: int, threads: int) -> tuple[str, ...]:
    return (
        "--dtype", "bfloat16", "--threads", str(threads), "--kv-cache-bytes", "64MiB",
        "--page-size", str(PAGE), "--max-num-batched-tokens", str(CHUNK), "--max-model-len", str(max_len),
        "--max-body-bytes", "64MiB", "--background-workers", "0", "--served-model-name", "windowed",
    )  # fmt: skip


def run(tokens: int, turn_tokens: int, threads: int = 1, redis_url: str = REDIS_URL) -> dict[str, Any]:
    import openai

    from tests.redis_server import delete_prefix, unique_prefix
    from tests.server import start_server

    max_len = tokens + 2 * turn_tokens + 1024
    rng = random.Random(0)
    out: dict[str, Any] = {"target_tokens": tokens, "turn_tokens": turn_tokens, "window": WINDOW, "turns": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = windowed_model_dir(Path(tmp) / "model", max_len)
        args = ("--redis-url", redis_url, "--kv-redis-url", redis_url, *serve_args(model, max_len, threads))
        prefix = unique_prefix()
        server = start_server(model, *args, log=Path(tmp) / "a.log", prefix=prefix)
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=3600)
            conv = client.conversations.create()
            t0, context = time.perf_counter(), 0
            words = max(1, turn_tokens * 10 // 27)
            while context < tokens:
                text = words_text(rng, words)
                t = time.perf_counter()
                r = client.responses.create(
                    model="windowed", conversation=conv.id, max_output_tokens=4, temperature=0,
                    input=[{"role": "user", "content": [{"type": "input_text", "text": text}]}],
                )  # fmt: skip
                assert r.usage is not None and r.status in ("completed", "incomplete"), r
                context = r.usage.input_tokens + r.usage.output_tokens
                cached = r.usage.input_tokens_details.cached_tokens
                out["turns"].append({"input_tokens": r.usage.input_tokens, "cached_tokens": cached,
                                     "text_bytes": len(text), "s": time.perf_counter() - t})  # fmt: skip
                print(f"  turn {len(out['turns'])}: context {context}, cached {cached}, "
                      f"{out['turns'][-1]['s']:.1f} s", file=sys.stderr)  # fmt: skip
            out["grow_s"] = time.perf_counter() - t0
            out["context_tokens"] = context
            out["items_before"] = stored_items(client, conv.id)
            server.stop()
            t = time.perf_counter()
            server = start_server(model, *args, log=Path(tmp) / "b.log", prefix=prefix)
            out["restart_s"] = time.perf_counter() - t
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=3600)
            out["items_after_restart"] = stored_items(client, conv.id)
            t = time.perf_counter()
            r = client.responses.create(
                model="windowed", conversation=conv.id, max_output_tokens=4, temperature=0,
                input=[{"role": "user", "content": [{"type": "input_text", "text": words_text(rng, 64)}]}],
            )  # fmt: skip
            assert r.usage is not None
            out["resume"] = {"input_tokens": r.usage.input_tokens, "s": time.perf_counter() - t,
                             "cached_tokens": r.usage.input_tokens_details.cached_tokens}  # fmt: skip
            out["items_after_turn"] = stored_items(client, conv.id)
        finally:
            server.stop()
            out["redis_keys_deleted"] = delete_prefix(redis_url, prefix)
    turns = out["turns"]
    out["per_turn_s"] = sum(x["s"] for x in turns) / len(turns)
    out["last_turn_s"] = turns[-1]["s"]
    out["resume_covers_window"] = out["resume"]["cached_tokens"] >= WINDOW
    out["items_intact"] = out["items_before"] == out["items_after_restart"]
    return out


def lines(r: dict[str, Any]) -> list[str]:
    """The report's lines for a serve run."""
    turns, res = r["turns"], r["resume"]
    return [
        f"serve: {len(turns)} turns to {r['context_tokens']} tokens in {r['grow_s']:.0f} s "
        f"(per turn {r['per_turn_s']:.1f} s, first {turns[0]['s']:.1f} s, last {r['last_turn_s']:.1f} s; "
        f"cached at the last turn {turns[-1]['cached_tokens']} of {turns[-1]['input_tokens']})",
        f"  restart {r['restart_s']:.1f} s; next turn: {res['input_tokens']} input tokens, "
        f"cached {res['cached_tokens']} "
        f"(window {r['window']}: {'covered' if r['resume_covers_window'] else 'NOT covered'}), {res['s']:.1f} s",
        f"  stored items before / after restart (count, JSON bytes): {tuple(r['items_before'])} / "
        f"{tuple(r['items_after_restart'])} ({'intact' if r['items_intact'] else 'CHANGED'}); "
        f"after the next turn {tuple(r['items_after_turn'])}",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--turn-tokens", type=int, default=32768)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--redis-url", default=REDIS_URL)
    a = p.parse_args()
    r = run(a.tokens, a.turn_tokens, a.threads, a.redis_url)
    print("\n".join(lines(r)), file=sys.stderr)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
