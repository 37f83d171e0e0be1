"""The `longctx` command line.

stdout carries only generated text; logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch


def _parse_bytes(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    t = text.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    return int(float(t))


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="directory, .gguf file, pulled name or repo id")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-cache-bytes", type=_parse_bytes, default=_parse_bytes("1GiB"), help="e.g. 512MiB, 4GB")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch_paged", "flashinfer"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")


def _generate(args: argparse.Namespace) -> int:
    from engine.attention.registry import make_backend
    from engine.generate import greedy_generate
    from engine.loader import load
    from engine.model_runner import ModelRunner
    from kvstore.block_pool import BlockPool
    from kvstore.kv_cache import KVCache
    from kvstore.spec import KVSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load(args.model, args.dtype, args.device)
    cfg, tok = loaded.config, loaded.tokenizer
    if args.chat:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    dtype_name = str(loaded.dtype).replace("torch.", "")
    spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.page_size, dtype_name)
    cache = KVCache.from_budget(spec, args.kv_cache_bytes, args.device)
    backend = make_backend(
        args.attention_backend, torch.device(args.device), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    )
    runner = ModelRunner(loaded.model, cache, backend)
    log = logging.getLogger("longctx.generate")
    log.info("KV cache: %d pages of %d tokens (%.1f MB)", cache.num_pages, args.page_size, cache.num_bytes / 1e6)
    t0 = time.perf_counter()
    (out,) = greedy_generate(runner, BlockPool(cache.num_pages), [prompt_ids], args.max_tokens, tok.eos_token_ids)
    dt = time.perf_counter() - t0
    log.info("%d prompt tokens, %d generated in %.2fs", len(prompt_ids), len(out), dt)
    sys.stdout.write(tok.decode(out, skip_special_tokens=True) + "\n")
    sys.stdout.flush()
    return 0


def _models(args: argparse.Namespace) -> int:
    from engine.model_source import models_dir, pull_demo

    if args.action == "pull":
        path = pull_demo(force=args.force)
        print(path)
    else:
        root = models_dir()
        for d in sorted(root.glob("*")) if root.exists() else []:
            print(d.name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longctx", description="longctx: a server for long-running agent sessions")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the chat template with a generation prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=_generate)

    models = sub.add_parser("models", help="manage models under $LONGCTX_HOME/models")
    models.add_argument("action", choices=["pull", "list"])
    models.add_argument("--force", action="store_true", help="fetch again even if present")
    models.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from engine.config import UnsupportedModel
    from engine.model_source import ModelNotFound
    from engine.safetensors_file import CheckpointError

    try:
        return int(args.func(args))
    except (ModelNotFound, UnsupportedModel, CheckpointError, ValueError) as e:
        print(f"longctx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
