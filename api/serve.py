"""`longctx serve`: the HTTP server process, from flags to a ready engine and back to exit 0.

Order of events:
1. Checks that need no work (a `redis-server` to manage, the model resolves): exit 2 if not.
2. The port is bound (uvicorn), so `/health` answers at once and `/ready` says the phase.
3. Startup phases, each timed and logged, blocking ones on a loader thread:
   redis (start or reuse the managed instances, or ping `--redis-url`), model (load, or wait
   for the load `api.model_load` started with the command, beside the imports and redis),
   engine (the engine process builds its KV pool and tiers; here the grammar compiler), compile
   (the engine process starts compiling the step's buckets in the background: they run eager until
   each is compiled, or found in `$LONGCTX_HOME/compile`, and self-checked; a sharded
   engine's ranks compile and check every bucket here, in step, before it serves), warm-up (a short
   generation through the process boundary and a schema compile), routes (the async Redis client
   and the route modules' startup hooks).
4. SIGTERM/SIGINT: no new work admitted (`ServerState.begin_drain`), streams get
   `--shutdown-grace-s` to finish (foreground responses still running near its end stop and commit
   `incomplete`; background jobs are handed back to the queue), uvicorn closes connections, the
   lifespan stops the engine and the hooks' resources, the managed Redis instances are released (the last user
   stops them), exit 0. A failed startup exits 1 after logging why; so does the engine process
   dying once ready (`/ready` answers 503 `engine_stopped` for `ENGINE_DEATH_EXIT_S` first).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import psutil
import uvicorn

from api import auth, limits, registration
from api.app import create_app
from api.managed_redis import INSTALL_HINT, ManagedRedis, cache_args, state_args
from api.model_load import ModelLoad
from api.state import ServeOptions, ServerState

if TYPE_CHECKING:
    from engine.verify.self_check import CompileReport

log = logging.getLogger("longctx.serve")

T = TypeVar("T")
# The warm-up's prompt: long enough that its prefill measures this engine's rate (what a tier
# lookup's wait is weighed against: `engine.scheduling.prefill_rate`), short enough to cost little.
WARMUP_PROMPT = " ".join(f"Bees of hive {i} made honey." for i in range(12))
WARMUP_TOKENS = 64
ENGINE_DEATH_EXIT_S = 1.0  # `/ready` says `engine_stopped` this long before the server exits 1


class _Server(uvicorn.Server):
    """uvicorn, minus re-raising the signal after a graceful shutdown (we exit 0 instead)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.state.draining:
            grace = self.state.options.shutdown_grace_s
            log.info("signal %d: no new work admitted; streams have %.1f s to finish", sig, grace)
        self.state.begin_drain()
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for connections
        self.should_exit = True


async def _in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a daemon thread (a shutdown during loading must not wait for it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the awaiting coroutine was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="longctx-loader", daemon=True).start()
    return await future


class Startup:
    """The startup phases for one `longctx serve` process; `managed` lists the Redis instances to release."""

    def __init__(
        self, args: argparse.Namespace, options: ServeOptions, server: _Server, model: ModelLoad | None = None
    ):
        self.args = args  # the model's flags, for a load not started with the command
        self.options = options
        self.server = server
        self.model = model  # already loading (`api.model_load`), or None: loaded in the model phase
        self.managed: list[ManagedRedis] = []
        self.kv_redis_url: str | None = None
        self.exit_code = 0

    def _redis(self, state: ServerState) -> None:
        o = self.options
        kv_flag = o.engine.kv_redis_url
        if self.args.redis_url is None:
            from engine.loading.model_source import longctx_home

            root = longctx_home() / "redis"
            instance = ManagedRedis(root, "state", state_args(root / "state"))
            instance.acquire()
            self.managed.append(instance)
            if kv_flag is None:
                kv = ManagedRedis(root, "kv", cache_args(root / "kv", o.kv_redis_max_memory))
                kv.acquire()
                self.managed.append(kv)
                kv_flag = kv.url
        elif kv_flag is None:
            kv_flag = o.redis_url
            log.info(
                "KV pages go to the state Redis under a %d s TTL; a separate cache instance "
                "(--kv-redis-url, maxmemory with allkeys-lru) keeps them from crowding out state",
                o.engine.kv_redis_ttl,
            )
        self.kv_redis_url = None if kv_flag == "none" else kv_flag
        import redis

        from kvstore.redis_connect import connect

        client = connect(state.options.redis_url, socket_connect_timeout=5, socket_timeout=5)
        try:
            client.ping()
        except redis.RedisError as e:
            raise RuntimeError(f"state Redis at {state.options.redis_url} does not answer: {e}") from e
        finally:
            client.close()
        log.info("state Redis %s; KV tier %s", state.options.redis_url, self.kv_redis_url or "off")

    def _model(self) -> Any:
        """The engine process's `loaded` phase: the model's tokenizer, config and load stats (its
        weights stay in the engine process)."""
        if self.model is None:
            self.model = ModelLoad(self.args, self.options.engine)
        return self.model.wait()

    def _engine(self, loaded: Any, state: ServerState) -> tuple[Any, Any]:
        import torch

        from tools.grammar import GrammarCompiler

        assert self.model is not None
        config, client = self.options.engine, self.model.client
        torch.set_num_threads(self.model.api_threads)
        client.on_death = lambda reason: self._engine_died(state, reason)
        client.tokenizer = loaded.tokenizer
        client.build(self.kv_redis_url, config.kv_redis_prefix, config.enable_prefix_caching, background=True)
        grammar = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)
        return client, grammar

    def _engine_died(self, state: ServerState, reason: str) -> None:
        """The engine process ended unasked: `/ready` answers 503 `engine_stopped` for a moment,
        then the server stops with exit code 1."""
        if state.draining:
            return
        state.error = reason
        self.exit_code = 1
        log.error("%s: the server stops in %.1f s", reason, ENGINE_DEATH_EXIT_S)

        def stop() -> None:
            self.server.should_exit = True

        timer = threading.Timer(ENGINE_DEATH_EXIT_S, stop)
        timer.daemon = True
        timer.start()

    def _compile(self) -> CompileReport | None:
        """The compiled step's background compile started in the engine process: every bucket
        runs eager until its graphs (from `$LONGCTX_HOME/compile` when cached, else compiled by a
        low-priority child process) are self-checked against the eager modules and switched in;
        a bucket that fails stays eager. Nothing here waits for a bucket, except on a
        sharded engine, whose ranks compile and check them together before it serves
        (`engine/distributed_runner.py`, `check_in_step`)."""
        assert self.model is not None
        report: CompileReport | None = self.model.client.wait_phase("compiled")
        return report

    @staticmethod
    def _warm_up(engine: Any, grammar: Any) -> None:
        from engine.sampling_params import SamplingParams

        ids = engine.tokenizer.encode(WARMUP_PROMPT)[: max(1, min(WARMUP_TOKENS, engine.max_model_len - 2))]
        handle = engine.add_request(ids, SamplingParams(max_tokens=2))
        for out in handle:
            if out.error:
                raise RuntimeError(f"warm-up generation failed: {out.error}")
        grammar.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}}, where="warm-up")

    async def _routes(self, state: ServerState) -> None:
        from kvstore.redis_connect import connect_async

        # the socket timeout stays above the event streams' blocking reads (5 s)
        client = connect_async(state.options.redis_url, socket_connect_timeout=5, socket_timeout=15)
        await client.ping()
        state.redis = client  # type: ignore[assignment]
        for hook in state.on_startup:
            await hook(state)

    async def _phase(self, state: ServerState, name: str, fn: Callable[[], Any]) -> Any:
        state.phase = name
        t0 = time.perf_counter()
        result = fn()
        if asyncio.iscoroutine(result):
            result = await result
        state.phase_seconds[name] = round(time.perf_counter() - t0, 3)
        log.info("phase %s: %.2fs", name, state.phase_seconds[name])
        return result

    async def run(self, state: ServerState) -> None:
        """The phases, once the port is bound; on failure the server exits with code 1."""
        while not self.server.started:  # bind first: /health answers during the phases
            if self.server.should_exit:
                return
            await asyncio.sleep(0.01)
        try:
            await self._phase(state, "redis", lambda: _in_thread(lambda: self._redis(state)))
            loaded = await self._phase(state, "model", lambda: _in_thread(self._model))
            state.loaded = loaded
            building = lambda: _in_thread(lambda: self._engine(loaded, state))  # noqa: E731
            engine, grammar = await self._phase(state, "engine", building)
            with state.lock:
                state.engine, state.grammar = engine, grammar
            engine.read_on(asyncio.get_running_loop())  # one wake-up a step (`engine/process/loop_reader.py`)
            compiling = lambda: _in_thread(self._compile)  # noqa: E731
            await self._phase(state, "compile", compiling)
            await self._phase(state, "warm-up", lambda: _in_thread(lambda: self._warm_up(engine, grammar)))
            await self._phase(state, "routes", lambda: self._routes(state))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("startup failed in phase %s", state.phase)
            state.error = f"startup failed in phase {state.phase}: {e}"
            state.phase = "failed"
            self.exit_code = 1
            self.server.should_exit = True
            return
        if state.draining:
            return
        state.phase, state.ready = "ready", True
        total = time.perf_counter() - state.started_at
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in state.phase_seconds.items())
        url = f"http://{self.options.host}:{self.options.port}/v1"
        since_start = time.time() - psutil.Process().create_time()  # the imports included
        log.info(
            "ready in %.2fs, %.1fs after the process started (%s): serving %s at %s",
            total, since_start, phases, state.options.service.model, url,
        )  # fmt: skip

    def release(self) -> None:
        if self.model is not None:  # a startup that failed or stopped before the engine was handed over
            self.model.finish()
        for instance in reversed(self.managed):
            try:
                instance.release()
            except Exception:
                log.exception("could not release managed redis-server (%s)", instance.name)


def run(
    args: argparse.Namespace,
    options: ServeOptions,
    routes: list[Any] | None = None,
    setup: Callable[[ServerState], None] | None = None,
    model: ModelLoad | None = None,
) -> int:
    """`longctx serve`. Returns the exit code (2: bad flags or no redis-server; 1: startup failed).

    Args:
        args: the model's flags (`api.model_load`), for a model not already loading.
        options: the settings the flags asked for (`api.serve_args.serve_options`).
        routes: the API's route handlers (routers, controllers).
        setup: called with the fresh state before the server starts; route modules append
            their resources' `on_startup` hooks (run in the `routes` phase, once the engine is
            warm) and `on_shutdown` hooks there.
        model: the model, already loading since the command started (`api.model_load`); the
            model phase waits for it. None: the model phase loads it.
    """
    if args.expert_parallel and args.tensor_parallel_size < 2:
        raise ValueError("--expert-parallel needs --tensor-parallel-size of 2 or more")
    if args.redis_url is None and shutil.which("redis-server") is None:
        print(f"longctx: error: {INSTALL_HINT}", flush=True, file=sys.stderr)
        return 2
    state = ServerState(options)
    try:
        auth.configure(state)
        limits.configure(state)
        registration.configure(state)
    except auth.KeysFileError as e:
        print(f"longctx: error: {e}", flush=True, file=sys.stderr)
        return 2
    if setup is not None:
        setup(state)
    holder: list[Startup] = []
    app = create_app(state, routes or [], start=lambda s: holder[0].run(s), debug=args.verbose)
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_config=None,
        access_log=args.verbose,
        timeout_graceful_shutdown=math.ceil(options.shutdown_grace_s),
    )
    server = _Server(config, state)
    startup = Startup(args, options, server, model)
    holder.append(startup)
    log.info("serving on http://%s:%d (/health at once, /ready once the model is warm)", options.host, options.port)
    try:
        server.run()
    except SystemExit as e:  # uvicorn could not bind the port
        return int(e.code) if isinstance(e.code, int) else 1
    finally:
        startup.release()
    if not server.started and startup.exit_code == 0:
        return 1  # the port could not be bound
    return startup.exit_code
