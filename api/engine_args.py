"""The engine's command-line flags, shared by `longctx generate`, `serve` and `doctor`, and the
`EngineConfig` they make."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

from engine.engine_config import EngineConfig
from engine.loading.model_source import DEMO_MODEL

log = logging.getLogger("longctx.cli")


def parse_bytes(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    t = text.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    return int(float(t))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags of every command that runs the engine; defaults are `EngineConfig`'s."""
    p.add_argument("--model", default=DEMO_MODEL, help="directory, .gguf file, pulled name or repo id")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=default_device())
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4"],
        help="weight-only quantization of every linear (CPU): int8 per channel, int4 per group",
    )
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128], help="int4 group size")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=EngineConfig.kv_cache_bytes, help="e.g. 512MiB, 4GB")
    p.add_argument("--page-size", type=int, default=EngineConfig.page_size, help="tokens per KV page")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens, help="token budget per step"
    )
    p.add_argument(
        "--max-prefill-tokens-per-request",
        type=int,
        default=EngineConfig.max_prefill_tokens_per_request,
        help="a prompt's share of the step budget while others wait (default: half the budget)",
    )
    p.add_argument(
        "--max-queued", type=int, default=EngineConfig.max_queued, help="requests queued before new ones are refused"
    )
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, help="requests running at once")
    p.add_argument(
        "--max-model-len", type=int, default=EngineConfig.max_model_len, help="context length (default: the model's)"
    )
    p.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help='config values merged in before loading, e.g. \'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 8192}, "max_position_embeddings": 32768}\'',
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|chatml|none",
        help="a Jinja chat template file, the built-in chatml, or none (chat requests refused); default: the "
        "checkpoint's, or chatml with a warning when it has none",
    )
    p.add_argument(
        "--attention-backend", default=EngineConfig.attention_backend, choices=["auto", "torch_paged", "flashinfer"]
    )
    p.add_argument(
        "--threads",
        type=int,
        default=EngineConfig.threads,
        help="CPU threads per rank (0 = torch's default, or cores/N)",
    )
    p.add_argument(
        "--host-cache-bytes",
        type=parse_bytes,
        default=EngineConfig.host_cache_bytes,
        help="host KV tier budget (0 = none)",
    )
    p.add_argument(
        "--kv-redis-url",
        default=EngineConfig.kv_redis_url,
        help="Redis KV tier, e.g. redis://127.0.0.1:6379/1 (serve: `none` = off)",
    )
    p.add_argument(
        "--kv-redis-ttl", type=int, default=EngineConfig.kv_redis_ttl, help="seconds a KV page lives in Redis unused"
    )
    p.add_argument(
        "--kv-redis-max-pending-bytes",
        type=parse_bytes,
        default=EngineConfig.kv_redis_max_pending_bytes,
        help="KV pages waiting to be written to Redis; more are dropped, never waited for",
    )
    p.add_argument(
        "--kv-prefetch-bytes",
        type=parse_bytes,
        default=EngineConfig.kv_prefetch_bytes,
        help="host memory for KV pages read ahead from Redis for requests waiting for room in the pool "
        "(0 = none; default: --kv-cache-bytes, at most 1GiB)",
    )
    p.add_argument(
        "--kv-lookup-timeout",
        type=float,
        default=EngineConfig.kv_lookup_timeout_s,
        help="seconds a request may wait for KV pages from the host/Redis tiers (less when recomputing is faster)",
    )
    p.add_argument(
        "--kv-dtype", default=EngineConfig.kv_dtype, choices=["auto", "int8"], help="storage dtype of the KV tiers"
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks to shard the model over (spawned unless torchrun)"
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the decode step (steps of <= 64 tokens); default: on when a C++ compiler "
        "and the Python headers are present (CPU, sharded ranks too), else eager",
    )
    p.add_argument(
        "--compile-buckets",
        type=_compile_buckets,
        default=None,
        metavar="N,N,...",
        help="the step sizes the compiled step compiles, some of 1,2,4,8,16,32,64 (default: all); a step "
        "runs padded to the smallest that holds it, past the largest eager. Fewer: a shorter cold start",
    )
    p.add_argument("--expert-parallel", action="store_true", help="MoE: whole experts per rank, tokens dispatched")
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages, each a slice of the layers on --tensor-parallel-size ranks (P x T ranks)",
    )
    p.add_argument(
        "--pipeline-layer-split",
        default="",
        help="layers per stage, e.g. 10,10,12 (default: as even as possible, the first stages one more)",
    )


def world_size(args: argparse.Namespace) -> int:
    """Processes the parallel flags ask for: tensor-parallel ranks x pipeline stages."""
    if args.pipeline_parallel_size < 1:
        raise ValueError("--pipeline-parallel-size must be >= 1")
    if args.pipeline_layer_split and args.pipeline_parallel_size < 2:
        raise ValueError("--pipeline-layer-split needs --pipeline-parallel-size of 2 or more")
    from engine.distributed.parallel import parse_layer_split

    split = parse_layer_split(args.pipeline_layer_split)  # the sum is checked against the model's layers at load
    if split and len(split) != args.pipeline_parallel_size:
        raise ValueError(
            f"--pipeline-layer-split has {len(split)} stages, --pipeline-parallel-size {args.pipeline_parallel_size}"
        )
    return int(args.tensor_parallel_size * args.pipeline_parallel_size)


def _compile_buckets(text: str) -> tuple[int, ...]:
    from engine.model.compiled import chosen_buckets

    parts = [b.strip() for b in text.split(",")]
    if not all(b.isdigit() for b in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated step sizes such as 1,8,64, got {text!r}")
    try:
        return chosen_buckets(tuple(int(b) for b in parts))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def want_compile(args: argparse.Namespace) -> bool:
    """`--compile` / `--no-compile`, or the default: compile where it can build (one warning if not)."""
    from engine.model.compile_setup import compile_available

    asked = args.compile
    if asked is False:
        return False
    missing = compile_available()
    world_size(args)  # the parallel flags' own checks first
    cpu = args.device == "cpu"  # (sharded ranks compile their shards)
    if asked:
        if missing:
            raise ValueError(f"--compile: {missing}")
        if not cpu:
            raise ValueError("--compile: the compiled step runs on CPU (no --device cuda)")
        return True
    if not cpu:
        return False
    if missing:
        log.warning("running eager (no compiled step): %s", missing)
        return False
    return True


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The `EngineConfig` the engine flags ask for; `overrides` replace fields (e.g. a managed
    KV Redis URL, a key prefix)."""
    fields: dict[str, Any] = dict(
        kv_cache_bytes=args.kv_cache_bytes,
        page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_per_request=args.max_prefill_tokens_per_request,
        max_queued=args.max_queued,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        threads=args.threads,
        host_cache_bytes=args.host_cache_bytes,
        kv_redis_url=args.kv_redis_url,
        kv_redis_ttl=args.kv_redis_ttl,
        kv_redis_max_pending_bytes=args.kv_redis_max_pending_bytes,
        kv_prefetch_bytes=args.kv_prefetch_bytes,
        kv_lookup_timeout_s=args.kv_lookup_timeout,
        kv_dtype=args.kv_dtype,
        compile=want_compile(args),
        compile_buckets=args.compile_buckets,
    )
    return EngineConfig(**(fields | overrides))
