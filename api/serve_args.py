"""`longctx serve`'s own flags, and the `ServeOptions` it runs with, built once from them.

Each flag's default is read from the config class that holds the setting (`ServeOptions`,
`sessions.config`), so every default is written once; values are checked by those classes as
they are built, and a bad one stops the command with exit code 2 before anything starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from api.engine_args import engine_config, parse_bytes, world_size
from api.state import ServeOptions
from sessions.config import ImageConfig, ServiceConfig, StoreConfig, WorkerConfig, generation_defaults


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `serve` besides the engine's (`api.engine_args.add_engine_args`)."""
    p.add_argument("--host", default=ServeOptions.host)
    p.add_argument("--port", type=int, default=ServeOptions.port)
    p.add_argument("--redis-url", default=None, help="state Redis; default: a managed redis-server")
    p.add_argument("--redis-prefix", default=StoreConfig.prefix, help="prefix of every state key")
    p.add_argument(
        "--advertise-url", default=None,
        help="the URL `longctx route --replicas-from-redis` reaches this server at, published in the state "
        "Redis (default: http://HOST:PORT)",
    )  # fmt: skip
    p.add_argument(
        "--state-ttl", type=int, default=StoreConfig.state_ttl_s, help="seconds conversations and responses live"
    )
    p.add_argument(
        "--background-workers", type=int, default=WorkerConfig.workers, help="background-response workers per process"
    )
    p.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=StoreConfig.lease_ttl_ms,
        help="a running turn's conversation lease expires after this long without renewal (its server "
        "died): its response then reads failed and the conversation takes new turns",
    )
    p.add_argument(
        "--job-claim-idle-s",
        type=float,
        default=WorkerConfig.claim_idle_s,
        help="a background job whose worker sent no heartbeat for this long (its server died) is "
        "taken over by another server",
    )
    p.add_argument(
        "--kv-commit-wait-ms",
        type=float,
        default=ServiceConfig.kv_commit_wait_s * 1000,
        help="a turn's commit waits up to this long for its KV pages to reach Redis (so the next turn "
        "finds them on any replica); pages still queued are marked pending, and the next lookup "
        "waits for them",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="never reuse KV pages across requests")
    p.add_argument(
        "--kv-redis-max-memory",
        type=parse_bytes,
        default=ServeOptions.kv_redis_max_memory,
        help="maxmemory of the managed KV-cache Redis",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=ServiceConfig.max_output_tokens,
        help="cap on a response's output tokens",
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    p.add_argument(
        "--tool-call-format",
        default=ServeOptions.tool_call_format,
        help="auto (from the chat template), hermes, llama3 or mistral",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=ServeOptions.shutdown_grace_s,
        help="on SIGTERM: seconds streams may take to finish",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=ServeOptions.max_body_bytes,
        help="largest request body (over: 413)",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults for requests that give none, e.g. '{\"temperature\": 0}' (temperature, top_p)",
    )
    p.add_argument(
        "--hosted-tools",
        default=ServiceConfig.hosted_tools,
        choices=["ignore", "reject"],
        help="hosted tools (web_search, ...) in a request: ignore (not offered to the model, echoed) or reject (400)",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs of image parts (default: data URLs only)",
    )
    p.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="with --allow-image-urls: fetch from loopback, link-local and private addresses too",
    )
    p.add_argument(
        "--max-image-bytes", type=parse_bytes, default=ImageConfig.max_bytes, help="largest image part (over: 400)"
    )
    p.add_argument(
        "--max-image-pixels", type=int, default=ImageConfig.max_pixels, help="most pixels of an image (over: 400)"
    )
    p.add_argument(
        "--max-images", type=int, default=ImageConfig.max_images, help="most image parts in one request (over: 400)"
    )
    p.add_argument(
        "--max-queued-per-tenant", type=int, default=None, help="waiting requests per tenant (default: --max-queued/2)"
    )
    p.add_argument(
        "--api-keys-file", type=Path, default=None, help="'KEY TENANT' per line (default: no auth, loopback)"
    )


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The settings `serve`'s flags ask for. Raises ValueError naming a bad value, ModelNotFound
    for a `--model` that does not resolve (the served name defaults to the model's)."""
    from api.model_load import placement
    from engine.loading.model_source import longctx_home, resolve_model

    model_name = resolve_model(args.model).name
    redis_url = args.redis_url or f"unix://{longctx_home() / 'redis' / 'state.sock'}"  # managed: its socket
    store = StoreConfig(prefix=args.redis_prefix, state_ttl_s=args.state_ttl, lease_ttl_ms=args.lease_ttl_ms)
    service = ServiceConfig(
        model=args.served_model_name or model_name,
        max_output_tokens=args.max_output_tokens,
        hosted_tools=args.hosted_tools,
        kv_commit_wait_s=args.kv_commit_wait_ms / 1000,
        lease_renew_s=min(ServiceConfig.lease_renew_s, store.lease_ttl_ms / 3000),  # a third of the lease
        images=ImageConfig(
            allow_urls=args.allow_image_urls,
            allow_private_urls=args.allow_private_image_urls,
            max_bytes=args.max_image_bytes,
            max_pixels=args.max_image_pixels,
            max_images=args.max_images,
        ),
        **generation_defaults(args.override_generation_config),
    )
    return ServeOptions(
        redis_url=redis_url,
        store=store,
        service=service,
        workers=WorkerConfig(workers=args.background_workers, claim_idle_s=args.job_claim_idle_s),
        engine=engine_config(
            args,
            # a sharded engine's ranks split the cores among them (`--threads`: per rank)
            threads=args.threads if world_size(args) > 1 else placement(args.threads)[0],
            enable_prefix_caching=not args.no_prefix_cache,
            kv_redis_prefix=f"{args.redis_prefix}:kv",
        ),
        tool_call_format=args.tool_call_format,
        shutdown_grace_s=args.shutdown_grace_s,
        max_body_bytes=args.max_body_bytes,
        max_queued_per_tenant=args.max_queued_per_tenant,
        api_keys_file=args.api_keys_file,
        kv_redis_max_memory=args.kv_redis_max_memory,
        host=args.host,
        port=args.port,
        advertise_url=args.advertise_url,
    )
