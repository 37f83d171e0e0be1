"""The `longctx` command line.

stdout carries only generated text; logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from api import chat_client, cli_tools
from api.doctor.options import add_doctor_args, doctor_options
from api.engine_args import add_engine_args
from api.generate import generate
from api.serve_args import add_serve_args
from api.state import ServeOptions
from engine.sampling_params import SamplingParams


def _serve(args: argparse.Namespace) -> int:
    from api.model_load import ModelLoad
    from api.serve_args import serve_options

    options = serve_options(args)
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1 and os.environ.get("RANK", "0") != "0":
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
    from api.auth import KeysFileError

    redis_url = args.redis_url if args.replicas_from_redis else None
    try:
        return serve(args.host, args.port, args.replica, redis_url, args.redis_prefix, args.api_keys_file)
    except KeysFileError as e:
        raise SystemExit(f"longctx route: error: {e}") from None


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
    gen.set_defaults(func=generate)

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
    route.add_argument(
        "--api-keys-file", type=Path, default=None,
        help="the replicas' keys file: refuse /v1 requests without one of its keys here (default: the replicas do)",
    )  # fmt: skip
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
