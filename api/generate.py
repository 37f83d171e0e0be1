"""`longctx generate`: one prompt through the engine, its text streamed to stdout.

Runs the engine process as `serve` does; tensor- and pipeline-parallel runs keep the engine in
this process, its ranks beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from typing import Any

import torch

from api.engine_args import engine_config, world_size
from engine.sampling_params import SamplingParams


def _check_buckets(engine: Any, prompt_len: int) -> None:
    """Compile and self-check the compiled step's buckets this prompt will use (its prefill
    chunks' and decoding's), as `serve` does for every bucket at start; one that fails runs eager."""
    from engine.model.compiled import CompiledStep

    step = engine.runner.step
    if isinstance(step, CompiledStep):  # a sharded engine's ranks all compile and check them, in step
        engine.runner.check_compiled(tuple(_buckets(engine.config.max_num_batched_tokens, prompt_len, step.buckets)))


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


def image_prompt(args: argparse.Namespace, loaded: Any) -> tuple[list[int], list[Any]]:
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


def generate(args: argparse.Namespace) -> int:
    """`longctx generate`: through the engine process, as `serve` runs it (tensor-parallel runs
    keep the engine in this process, its ranks beside it)."""
    from api.cli_tools import check_files

    check_files(args)  # a wrong --tools / --json-schema file fails before the model loads
    if world_size(args) > 1 or args.expert_parallel:
        return _generate_in_process(args)
    from api.model_load import core_spec, engine_wait_policy, placement
    from engine.model.compiled import chosen_buckets
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
            prompt_ids, images = image_prompt(args, loaded)
        chosen = chosen_buckets(config.compile_buckets)
        buckets = _buckets(config.max_num_batched_tokens, len(prompt_ids), chosen) if config.compile else []
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


def _buckets(budget: int, prompt_len: int, chosen: tuple[int, ...]) -> list[int]:
    """The compiled step's buckets (of those `chosen`) a prompt will use: its prefill chunks' and
    decoding's."""
    from engine.model.compiled import bucket_for

    chunks = [budget] * (prompt_len // budget) + ([prompt_len % budget] if prompt_len % budget else [])
    return sorted(b for b in {bucket_for(n, chosen) for n in [*chunks, 1]} if b is not None)


def _generate_in_process(args: argparse.Namespace) -> int:
    from engine.distributed.parallel import SINGLE
    from engine.engine import Engine
    from engine.loading.loader import load

    parallel, watchdog = SINGLE, None
    if args.expert_parallel and args.tensor_parallel_size < 2:
        raise ValueError("--expert-parallel needs --tensor-parallel-size of 2 or more")
    if world_size(args) > 1:
        from engine.distributed.launch import init_parallel
        from engine.distributed.parallel import parse_layer_split

        split = parse_layer_split(args.pipeline_layer_split)
        parallel, watchdog = init_parallel(
            args.tensor_parallel_size, args.expert_parallel, args.device,
            pipeline_size=args.pipeline_parallel_size, layer_split=split,
        )  # fmt: skip
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
        prompt_ids, images = image_prompt(args, loaded)
    runner = None
    if watchdog is not None:
        from engine.distributed_runner import DistributedRunner
        from engine.model_runner import ModelRunner

        local = ModelRunner.for_model(loaded.model, args.page_size, args.kv_cache_bytes, args.attention_backend)
        runner = DistributedRunner(local, parallel, watchdog, config)  # the other ranks build their KV tiers too
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
