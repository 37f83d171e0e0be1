"""The `longctx` command line.

stdout carries only generated text; logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from api import chat_client, cli_tools
from api.doctor.options import add_doctor_args, doctor_options
from api.engine_args import add_engine_args, engine_config
from api.serve_args import add_serve_args
from api.state import ServeOptions
from engine.sampling_params import SamplingParams


def _check_buckets(engine: Any, prompt_len: int) -> None:
    """Compile and self-check the compiled step's buckets this prompt will use (its prefill
    chunks' and decoding's), as `serve` does for every bucket at start; one that fails runs eager."""
    from engine.model.compiled import CompiledStep, bucket_for
    from engine.verify.self_check import warm_up_and_check

    step = engine.runner.step
    if not isinstance(step, CompiledStep):
        return
    budget = engine.config.max_num_batched_tokens
    chunks = [budget] * (prompt_len // budget) + ([prompt_len % budget] if prompt_len % budget else [])
    buckets = {bucket_for(n) for n in chunks} | {1}
    warm_up_and_check(step, engine.kv_spec.page_size, tuple(sorted(b for b in buckets if b is not None)))


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )


def _prompt(args: argparse.Namespace, tok: Any, vocab_size: int, params: Any) -> tuple[list[int], Any, Any]:
    """(prompt ids, sampling params, the structured run or None) of the generate flags."""
    structured = None
    if args.tools is not None or args.json_schema is not None:
        from api.cli_tools import StructuredRun

        structured = StructuredRun.from_args(args, tok, vocab_size)
        prompt_ids = structured.prompt_ids
        params = dataclasses.replace(params, skip_special_tokens=structured.skip_special_tokens)
    elif args.chat:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    return prompt_ids, params, structured


def _image_prompt(args: argparse.Namespace, loaded: Any) -> tuple[list[int], list[Any]]:
    """`--image` files with `--prompt`: the prompt ids with each image's placeholder run (where the
    prompt writes the model's image marker, else before the text; with `--chat`, as the chat
    template places image parts) and the images' preprocessed inputs."""
    from engine.loading.images import ImageProcessor

    vision = loaded.config.vision
    if vision is None:
        raise ValueError(f"--image: the model {loaded.source.name} ({loaded.config.architecture}) takes no image input")
    if args.tools is not None or args.json_schema is not None:
        raise ValueError("--image: not with --tools or --json-schema")
    processor = ImageProcessor.load(loaded.source.path, vision)
    images = []
    for path in args.image:
        try:
            images.append(path.read_bytes())
        except OSError as e:
            raise ValueError(f"--image {path}: cannot read the file ({e.strerror or e})") from None
    if args.chat:
        text = processor.chat_text(loaded.tokenizer.hf, args.prompt, len(images))
        return processor.prompt(text, images, add_special_tokens=False)
    return processor.prompt(args.prompt, images)


def _stream(handle: Any, structured: Any) -> int:
    """Write a request's text to stdout as it comes; returns the tokens generated."""
    log = logging.getLogger("longctx.generate")
    n = 0
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
    return n


def _generate(args: argparse.Namespace) -> int:
    """`longctx generate`: through the engine process, as `serve` runs it (tensor-parallel runs
    keep the engine in this process, its ranks beside it)."""
    if args.tensor_parallel_size > 1 or args.expert_parallel:
        return _generate_in_process(args)
    from api.model_load import core_spec, engine_wait_policy, placement
    from engine.process.client import EngineClient

    engine_threads, api_threads = placement(args.threads)
    torch.set_num_threads(api_threads)
    config = engine_config(args, threads=engine_threads)
    client = EngineClient(core_spec(args, config), engine_wait_policy())
    try:
        loaded = client.wait_phase("loaded")
        client.tokenizer = tok = loaded.tokenizer
        prompt_ids, params, structured = _prompt(args, tok, loaded.config.vocab_size, _params(args))
        images = None
        if args.image:
            prompt_ids, images = _image_prompt(args, loaded)
        buckets = _buckets(config.max_num_batched_tokens, len(prompt_ids)) if config.compile else []
        client.build(config.kv_redis_url, config.kv_redis_prefix, config.enable_prefix_caching, buckets)
        client.wait_phase("compiled")
        t0 = time.perf_counter()
        handle = client.add_request(
            prompt_ids, params, matcher=structured.matcher if structured else None, images=images
        )
        n = _stream(handle, structured)
    finally:
        client.shutdown()
    dt = time.perf_counter() - t0
    logging.getLogger("longctx.generate").info(
        "%d prompt tokens, %d generated in %.2fs (%.1f tokens/s)", len(prompt_ids), n, dt, n / dt if dt else 0
    )
    return 0


def _buckets(budget: int, prompt_len: int) -> list[int]:
    """The compiled step's buckets a prompt will use: its prefill chunks' and decoding's."""
    from engine.model.compiled import bucket_for

    chunks = [budget] * (prompt_len // budget) + ([prompt_len % budget] if prompt_len % budget else [])
    return sorted(b for b in {bucket_for(n) for n in chunks} | {1} if b is not None)


def _generate_in_process(args: argparse.Namespace) -> int:
    from engine.distributed.parallel import SINGLE
    from engine.engine import Engine
    from engine.loading.loader import load

    parallel, watchdog = SINGLE, None
    if args.tensor_parallel_size > 1:
        from engine.distributed.launch import init_parallel

        parallel, watchdog = init_parallel(args.tensor_parallel_size, args.expert_parallel, args.device)
    elif args.expert_parallel:
        raise ValueError("--expert-parallel needs --tensor-parallel-size of 2 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = engine_config(args)
    from engine.loading.overrides import parse_overrides

    loaded = load(
        args.model, args.dtype, args.device, parallel=parallel, quantization=args.quantization,
        group_size=args.group_size, hf_overrides=parse_overrides(args.hf_overrides), chat_template=args.chat_template,
    )  # fmt: skip
    if not parallel.is_driver:  # ranks 1..N-1 replay rank 0's steps until it stops them
        from engine.distributed_runner import serve_worker

        serve_worker(loaded.model, parallel, watchdog)
        return 0
    tok = loaded.tokenizer
    prompt_ids, params, structured = _prompt(args, tok, loaded.config.vocab_size, _params(args))
    images = None
    if args.image:
        prompt_ids, images = _image_prompt(args, loaded)
    runner = None
    if watchdog is not None:
        from engine.distributed_runner import DistributedRunner
        from engine.model_runner import ModelRunner

        local = ModelRunner.for_model(loaded.model, args.page_size, args.kv_cache_bytes, args.attention_backend)
        runner = DistributedRunner(local, parallel, watchdog)
    engine = Engine(loaded.model, tok, config, parallel=parallel, fingerprint=loaded.stats.fingerprint, runner=runner)
    _check_buckets(engine, len(prompt_ids))
    t0 = time.perf_counter()
    handle = engine.add_request(prompt_ids, params, matcher=structured.matcher if structured else None, images=images)
    with engine:
        n = _stream(handle, structured)
    if runner is not None and watchdog is not None:
        from engine.distributed.launch import finish_parallel

        runner.shutdown()
        finish_parallel(watchdog)
    dt = time.perf_counter() - t0
    logging.getLogger("longctx.generate").info(
        "%d prompt tokens, %d generated in %.2fs (%.1f tokens/s)", len(prompt_ids), n, dt, n / dt if dt else 0
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from api.model_load import ModelLoad
    from api.serve_args import serve_options

    options = serve_options(args)
    if args.tensor_parallel_size > 1 and os.environ.get("RANK", "0") != "0":
        # under torchrun: ranks 1..N-1 serve no HTTP, they replay rank 0's engine steps
        from api.model_load import core_spec
        from engine.process.ranks import worker_main

        return worker_main(core_spec(args, options.engine))
    model = ModelLoad.start(args, options.engine)  # loads while the HTTP stack below is imported
    try:
        from api import chat, conversations, responses
        from api.serve import run
    finally:
        if model is not None:
            model.imported()

    routes = [responses.router, conversations.router, chat.router]
    try:
        return run(args, options, routes=routes, setup=responses.setup, model=model)
    finally:
        if model is not None:
            model.finish()


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


def _doctor(args: argparse.Namespace) -> int:
    from api.doctor import run_doctor
    from api.doctor.report import print_summary

    options = doctor_options(args)
    report = run_doctor(args.model, options)
    print_summary(report)
    if args.report is not None:
        report.write_json(args.report)
    return 1 if report.failed else 0


def _route(args: argparse.Namespace) -> int:
    from api.router.proxy import serve

    if not args.replica and not args.replicas_from_redis:
        raise SystemExit("longctx route: error: give --replica URL (repeat) or --replicas-from-redis")
    if args.replicas_from_redis and args.redis_url is None:
        raise SystemExit("longctx route: error: --replicas-from-redis needs --redis-url (the replicas' state Redis)")
    return serve(
        args.host, args.port, args.replica, args.redis_url if args.replicas_from_redis else None, args.redis_prefix
    )


def _state(args: argparse.Namespace) -> int:
    import redis

    from sessions.migrate import migrate

    client = redis.Redis.from_url(args.redis_url)
    try:
        done = migrate(client, args.redis_prefix)
    finally:
        client.close()
    print(f"migrated {done.keys} keys ({done.conversations} conversations, {done.responses} responses)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longctx", description="longctx: a server for long-running agent sessions")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the chat template with a generation prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    gen.add_argument("--top-k", type=int, default=SamplingParams.top_k, help="0 = off")
    gen.add_argument("--min-p", type=float, default=SamplingParams.min_p)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", nargs="+", default=None, help="stop strings (never printed)")
    gen.add_argument(
        "--image", type=Path, action="append", default=None,
        help="an image file for a vision-language model (repeat for more, in order); it goes where the prompt "
        "has the model's image marker (e.g. <image>), else before the text",
    )  # fmt: skip
    cli_tools.add_arguments(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="the HTTP server (Responses and Conversations APIs)")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=_serve)

    doc = sub.add_parser("doctor", help="check that a checkpoint runs correctly here (a Day-0 report)")
    add_doctor_args(doc)
    doc.set_defaults(func=_doctor)

    chat = sub.add_parser("chat", help="a terminal client: chat with a running server")
    chat_client.add_arguments(chat)
    chat.set_defaults(func=chat_client.run)

    route = sub.add_parser("route", help="a cache-aware front for N serve replicas (each turn goes where its cache is)")
    route.add_argument("--host", default=ServeOptions.host)
    route.add_argument("--port", type=int, default=8080)
    route.add_argument("--replica", action="append", default=[], help="a replica's URL (repeat)")
    route.add_argument(
        "--replicas-from-redis", action="store_true",
        help="also route to the replicas registered in the state Redis (--redis-url, --redis-prefix): they "
        "join when they start and leave when they stop or their entry expires",
    )  # fmt: skip
    route.add_argument("--redis-url", default=None, help="the replicas' state Redis (--replicas-from-redis)")
    route.add_argument("--redis-prefix", default="lc", help="the replicas' --redis-prefix")
    route.set_defaults(func=_route)

    state = sub.add_parser("state", help="the state Redis: `migrate` an old key layout to today's")
    state.add_argument("action", choices=["migrate"])
    state.add_argument("--redis-url", required=True, help="the state Redis (one server, not a Cluster)")
    state.add_argument("--redis-prefix", default="lc", help="prefix of every state key")
    state.set_defaults(func=_state)

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
        if getattr(args, "hf_overrides", None):  # a bad key stops here, before anything loads
            from engine.loading.overrides import check_keys, parse_overrides

            check_keys(parse_overrides(args.hf_overrides))
        return int(args.func(args))
    except (ModelNotFound, UnsupportedModel, CheckpointError, ValueError) as e:
        print(f"longctx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
