"""The `longctx` command line.

stdout carries only generated text; logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from api import cli_tools


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
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4"],
        help="weight-only quantization of every linear (CPU): int8 per channel, int4 per group",
    )
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128], help="int4 group size")
    p.add_argument("--kv-cache-bytes", type=_parse_bytes, default=_parse_bytes("1GiB"), help="e.g. 512MiB, 4GB")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch_paged", "flashinfer"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0 = torch's default, or cores/N)")
    p.add_argument("--host-cache-bytes", type=_parse_bytes, default=0, help="host KV tier budget (0 = none)")
    p.add_argument("--kv-redis-url", default=None, help="Redis KV tier, e.g. redis://127.0.0.1:6379/1")
    p.add_argument("--kv-redis-ttl", type=int, default=86_400, help="seconds a KV page lives in Redis")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"], help="storage dtype of the KV tiers")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks to shard the model over (spawned unless torchrun)"
    )
    p.add_argument("--expert-parallel", action="store_true", help="MoE: whole experts per rank, tokens dispatched")


def _generate(args: argparse.Namespace) -> int:
    from engine.distributed.parallel import SINGLE
    from engine.engine import Engine, EngineConfig
    from engine.loading.loader import load
    from engine.sampling_params import SamplingParams

    parallel, watchdog = SINGLE, None
    if args.tensor_parallel_size > 1:
        from engine.distributed.launch import init_parallel

        parallel, watchdog = init_parallel(args.tensor_parallel_size, args.expert_parallel, args.device)
    elif args.expert_parallel:
        raise ValueError("--expert-parallel needs --tensor-parallel-size of 2 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
    config = EngineConfig(
        kv_cache_bytes=args.kv_cache_bytes,
        page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        host_cache_bytes=args.host_cache_bytes,
        kv_redis_url=args.kv_redis_url,
        kv_redis_ttl=args.kv_redis_ttl,
        kv_dtype=args.kv_dtype,
    )
    loaded = load(
        args.model,
        args.dtype,
        args.device,
        parallel=parallel,
        quantization=args.quantization,
        group_size=args.group_size,
    )
    if not parallel.is_driver:  # ranks 1..N-1 replay rank 0's steps until it stops them
        from engine.distributed_runner import serve_worker

        serve_worker(loaded.model, parallel, watchdog)
        return 0
    tok = loaded.tokenizer
    structured = None
    if args.tools is not None or args.json_schema is not None:
        from api.cli_tools import StructuredRun

        structured = StructuredRun.from_args(args, tok, loaded.config.vocab_size)
        prompt_ids = structured.prompt_ids
    elif args.chat:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    runner = None
    if watchdog is not None:
        from engine.distributed_runner import DistributedRunner
        from engine.model_runner import ModelRunner

        local = ModelRunner.for_model(loaded.model, args.page_size, args.kv_cache_bytes, args.attention_backend)
        runner = DistributedRunner(local, parallel, watchdog)
    engine = Engine(loaded.model, tok, config, parallel=parallel, fingerprint=loaded.stats.fingerprint, runner=runner)
    log = logging.getLogger("longctx.generate")
    t0 = time.perf_counter()
    handle = engine.add_request(prompt_ids, params, matcher=structured.matcher if structured else None)
    n = 0
    with engine:
        for out in handle:
            n += len(out.token_ids)
            text = out.text_delta
            if structured is not None:
                text = structured.feed(text, last=out.finish_reason is not None)
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
            if out.error:
                log.error("%s", out.error)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if runner is not None and watchdog is not None:
        from engine.distributed.launch import finish_parallel

        runner.shutdown()
        finish_parallel(watchdog)
    dt = time.perf_counter() - t0
    log.info("%d prompt tokens, %d generated in %.2fs (%.1f tokens/s)", len(prompt_ids), n, dt, n / dt if dt else 0)
    return 0


def _models(args: argparse.Namespace) -> int:
    from engine.loading.model_source import models_dir, pull_demo

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
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", nargs="+", default=None, help="stop strings (never printed)")
    cli_tools.add_arguments(gen)
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
    from engine.loading.model_source import ModelNotFound
    from engine.loading.safetensors_file import CheckpointError
    from engine.model.config import UnsupportedModel

    try:
        return int(args.func(args))
    except (ModelNotFound, UnsupportedModel, CheckpointError, ValueError) as e:
        print(f"longctx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
