"""What the running server holds: its options, its startup phase, and the resources routes use.

`ServerState` is filled by the startup phases (`api/serve.py`) on a loader thread while the
HTTP port already answers, and emptied by the app's lifespan on shutdown. Routes read it
from `request.app.state.server`; they may use `engine`, `redis`, `grammar` and `sessions` only
once `ready` is set (`require_ready` raises `NotReady`, a 503, before that).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.engine_config import EngineConfig
from sessions.config import ServiceConfig, StoreConfig, WorkerConfig

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from api.served_log import ServedLog
    from api.tenant_queue import TenantQueue
    from engine.loading.loader import LoadedModel
    from engine.process.client import EngineClient
    from engine.verify.self_check import CompileReport
    from sessions.service import SessionService
    from sessions.tasks import BackgroundWorkers
    from tools.grammar import GrammarCompiler

Hook = Callable[["ServerState"], Awaitable[None]]


class NotReady(RuntimeError):
    """The server is still starting (or is stopping): answered 503 with its phase."""


@dataclass(frozen=True)
class ServeOptions:
    """`longctx serve`'s settings, built once from its flags (`api.serve_args.serve_options`) and
    handed down whole: each layer takes its own config object from here as it is.

    Args:
        redis_url: the state Redis (the managed one's unix socket URL in managed mode).
        store: the session store's (`--redis-prefix`, `--state-ttl`).
        service: the session service's (the served model name, `--max-output-tokens`,
            `--hosted-tools`, `--kv-commit-wait-ms`, `--override-generation-config`).
        workers: the background workers' (`--background-workers`, `--job-claim-idle-s`).
        engine: the engine's (the engine flags; `kv_redis_url` is `--kv-redis-url` as given, the
            Redis phase settles the tier's URL).
        tool_call_format: `auto` (from the chat template) or a format name (`tools.formats`).
        shutdown_grace_s: on SIGTERM, how long streams and background jobs may take to finish.
        max_body_bytes: the largest request body (over: 413).
        max_queued_per_tenant: waiting requests per tenant (None: half of `engine.max_queued`).
        api_keys_file: 'KEY TENANT' lines (None: no auth, loopback only).
        kv_redis_max_memory: maxmemory of the managed KV-cache Redis.
        host, port: where the HTTP server listens.
        advertise_url: the URL published in the replica registry (None: http://host:port).
    """

    redis_url: str
    store: StoreConfig = field(default_factory=StoreConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tool_call_format: str = "auto"
    shutdown_grace_s: float = 10.0
    max_body_bytes: int = 8 << 20
    max_queued_per_tenant: int | None = None
    api_keys_file: Path | None = None
    kv_redis_max_memory: int = 2 << 30
    host: str = "127.0.0.1"
    port: int = 8000
    advertise_url: str | None = None

    def __post_init__(self) -> None:
        if self.shutdown_grace_s < 0 or self.max_body_bytes < 1:
            raise ValueError("--shutdown-grace-s must be >= 0 and --max-body-bytes >= 1")
        if self.max_queued_per_tenant is not None and self.max_queued_per_tenant < 1:
            raise ValueError(f"--max-queued-per-tenant must be >= 1, got {self.max_queued_per_tenant}")

    @property
    def per_tenant_queue(self) -> int:
        """`max_queued_per_tenant`, or half of the engine's `max_queued` (at least 1)."""
        if self.max_queued_per_tenant is not None:
            return self.max_queued_per_tenant
        return max(1, self.engine.max_queued // 2)


@dataclass
class ServerState:
    options: ServeOptions
    phase: str = "starting"  # starting, redis, model, engine, warm-up, routes, ready, stopping, failed
    phase_seconds: dict[str, float] = field(default_factory=dict)
    started_at: float = field(default_factory=time.perf_counter)
    ready: bool = False
    draining: bool = False  # SIGTERM seen: no new work is admitted
    error: str | None = None  # why startup failed
    loaded: LoadedModel | None = None
    engine: EngineClient | None = None  # the engine process's client (`engine/process/client.py`)
    redis: Redis | None = None  # redis.asyncio client of the state Redis, bound to the server's loop
    grammar: GrammarCompiler | None = None  # for the model's tokenizer
    # Run on the event loop during the `routes` phase (e.g. build the session store and
    # service, start background workers) and, in reverse order, on shutdown.
    on_startup: list[Hook] = field(default_factory=list)
    on_shutdown: list[Hook] = field(default_factory=list)
    # What the route modules add:
    api_keys: dict[str, str] | None = None  # KEY -> TENANT (`api.auth`); None: no auth
    tenant_queue: TenantQueue | None = None  # each tenant's waiting requests (`api.limits`)
    served: ServedLog | None = None  # what this replica served lately, for the registry (`api.registration`)
    sessions: SessionService | None = None  # the Responses service, once the routes phase built it
    workers: BackgroundWorkers | None = None  # background-response workers, and the task running them
    workers_task: asyncio.Task[None] | None = None
    stopping: asyncio.Task[int] | None = None  # stops the foreground turns on SIGTERM (kept until exit)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Called (from the signal handler: keep them short, no awaiting) when SIGTERM starts the drain.
    on_drain: list[Callable[[], None]] = field(default_factory=list)
    drain_deadline: float | None = None  # time.monotonic() by which every stream must have ended

    @property
    def compile_report(self) -> CompileReport | None:
        """The compiled step's buckets and their self-check, as the engine last reported them."""
        engine = self.engine
        return None if engine is None else engine.compile_report  # type: ignore[no-any-return]

    def begin_drain(self) -> None:
        """No new work from now on; the grace (`shutdown_grace_s`) starts once."""
        self.draining, self.ready = True, False
        if self.drain_deadline is not None:
            return
        self.drain_deadline = time.monotonic() + self.options.shutdown_grace_s
        for callback in self.on_drain:
            try:
                callback()
            except Exception:
                logging.getLogger("longctx.serve").exception("drain callback failed")

    def grace_left(self) -> float:
        """Seconds left of the shutdown grace (the whole grace before a drain began)."""
        if self.drain_deadline is None:
            return self.options.shutdown_grace_s
        return max(0.0, self.drain_deadline - time.monotonic())

    def require_ready(self) -> None:
        """Raise NotReady unless the server is ready and not shutting down."""
        if self.draining:
            raise NotReady("the server is shutting down")
        if not self.ready:
            raise NotReady(f"the server is starting (phase: {self.phase})")
