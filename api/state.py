"""What the running server holds: its options, its startup phase, and the resources routes use.

`ServerState` is filled by the startup phases (`api/serve.py`) on a loader thread while the
HTTP port already answers, and emptied by the app's lifespan on shutdown. Routes read it
from `request.app.state.server`; they may use `engine`, `redis` and `grammar` only once
`ready` is set (`require_ready` raises `NotReady`, a 503, before that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from engine.loading.loader import LoadedModel
    from engine.process.client import EngineClient
    from engine.verify.self_check import CompileReport

Hook = Callable[["ServerState"], Awaitable[None]]


class NotReady(RuntimeError):
    """The server is still starting (or is stopping): answered 503 with its phase."""


@dataclass(frozen=True)
class ServeOptions:
    """The `longctx serve` settings that routes and the session layer read.

    Args:
        redis_url: the state Redis (the managed one's unix socket URL in managed mode).
        redis_prefix: prefix `P` of every state key.
        state_ttl_s: expiry of conversations and responses, refreshed by writes.
        background_workers: background-job workers per process.
        job_claim_idle_s: `--job-claim-idle-s` (`sessions.tasks.BackgroundWorkers`).
        kv_commit_wait_ms: `--kv-commit-wait-ms` (`sessions.config.ServiceConfig.kv_commit_wait_s`).
        max_output_tokens: cap on a response's output tokens (the default when none is asked).
        served_model_name: the `model` the server answers to and reports.
        tool_call_format: `auto` (from the chat template) or a format name (`tools.formats`).
        shutdown_grace_s: on SIGTERM, how long streams and background jobs may take to finish.
        hosted_tools: `--hosted-tools` (`sessions.config.ServiceConfig`).
        generation: default `temperature` / `top_p` of requests that give none.
    """

    redis_url: str
    redis_prefix: str = "lc"
    state_ttl_s: int = 30 * 86_400
    background_workers: int = 2
    job_claim_idle_s: float = 30.0
    kv_commit_wait_ms: float = 50.0
    max_output_tokens: int = 4096
    served_model_name: str = ""
    tool_call_format: str = "auto"
    shutdown_grace_s: float = 10.0
    hosted_tools: str = "ignore"
    generation: dict[str, float] = field(default_factory=dict)  # `--override-generation-config`

    def __post_init__(self) -> None:
        if not self.redis_prefix or any(c.isspace() for c in self.redis_prefix):
            raise ValueError(f"--redis-prefix must be non-empty without spaces, got {self.redis_prefix!r}")
        if self.state_ttl_s < 1 or self.max_output_tokens < 1 or self.background_workers < 0:
            raise ValueError("--state-ttl and --max-output-tokens must be >= 1, --background-workers >= 0")
        if self.job_claim_idle_s <= 0 or self.kv_commit_wait_ms < 0:
            raise ValueError("--job-claim-idle-s must be > 0 and --kv-commit-wait-ms >= 0")


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
    grammar: Any = None  # tools.grammar.GrammarCompiler for the model's tokenizer
    compile_report: CompileReport | None = None  # the compiled step's buckets and their self-check
    # Run on the event loop during the `routes` phase (e.g. build the session store and
    # service, start background workers) and, in reverse order, on shutdown.
    on_startup: list[Hook] = field(default_factory=list)
    on_shutdown: list[Hook] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)  # resources the route modules add
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Called (from the signal handler: keep them short, no awaiting) when SIGTERM starts the drain.
    on_drain: list[Callable[[], None]] = field(default_factory=list)
    drain_deadline: float | None = None  # time.monotonic() by which every stream must have ended

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
