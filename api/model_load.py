"""`longctx serve`'s engine process, started from the moment the command starts, and where each
process's threads go.

The engine core runs in a process of its own (`engine/process/main.py`, driven through
`engine.process.client.EngineClient`): it loads the model while this process imports the HTTP
stack (Litestar, xgrammar, transformers) and runs the Redis phase, then builds the engine once
`build()` brings the KV Redis URL. This process keeps HTTP, sessions, tokenization and grammar
compiling. This module imports nothing heavy itself.

Thread placement (`placement`), decided here for both processes:
- up to 4 cores (2 here): the engine gets every core as torch threads (`--threads` overrides),
  its OpenMP workers spinning briefly between parallel regions (libgomp's default wait policy:
  they sleep once idle; `LONGCTX_ENGINE_OMP_WAIT_POLICY` sets another); this process gets 1
  torch thread and PASSIVE OpenMP workers (set in `api/__init__.py`), so its event loop,
  tokenizer and Redis threads share the cores with the engine without spinning against it;
- more cores (16): the engine gets all but 2 (14), this process 2 threads and the 2 cores'
  worth of room for its event loop, tokenization and xgrammar's compile threads.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig

API_THREADS_SMALL, API_THREADS_LARGE = 1, 2
SMALL_MACHINE_CORES = 4


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def placement(threads: int = 0, num_cores: int | None = None) -> tuple[int, int]:
    """(the engine process's torch threads, this process's), for `--threads` (0: decide)."""
    n = num_cores or cores()
    if n <= SMALL_MACHINE_CORES:
        return threads or n, API_THREADS_SMALL
    return threads or n - API_THREADS_LARGE, API_THREADS_LARGE


def engine_wait_policy() -> str | None:
    """The engine process's `OMP_WAIT_POLICY`: `LONGCTX_ENGINE_OMP_WAIT_POLICY` (ACTIVE, PASSIVE),
    else OpenMP's default."""
    return os.environ.get("LONGCTX_ENGINE_OMP_WAIT_POLICY") or None


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`engine.loading.loader.load`'s arguments for the serve flags."""
    from engine.loading.overrides import parse_overrides

    return dict(
        spec=args.model,
        dtype=args.dtype,
        device=args.device,
        progress=False,
        quantization=args.quantization,
        group_size=args.group_size,
        hf_overrides=parse_overrides(args.hf_overrides),
        chat_template=args.chat_template,
    )


def core_spec(args: argparse.Namespace, config: EngineConfig) -> Any:
    """The engine process's `LoadSpec`: the model flags' load, and `config` (its threads placed)."""
    from engine.process.main import LoadSpec

    level = logging.getLogger("longctx").getEffectiveLevel()
    return LoadSpec(
        load=load_kwargs(args), config=config, threads=config.threads, log_level=level,
        tensor_parallel_size=args.tensor_parallel_size, expert_parallel=args.expert_parallel,
        pipeline_parallel_size=args.pipeline_parallel_size, pipeline_layer_split=args.pipeline_layer_split,
    )  # fmt: skip


class ModelLoad:
    """The engine process for the serve flags, started at once (it loads while we import).

    Args:
        config: the engine's settings, `threads` already placed (`placement`).
    """

    def __init__(self, args: argparse.Namespace, config: EngineConfig):
        from engine.process.client import EngineClient

        self.args = args
        self.started_at = time.perf_counter()
        self.engine_threads, self.api_threads = placement(config.threads)
        self.client = EngineClient(core_spec(args, config), engine_wait_policy())
        logging.getLogger("longctx.serve").info(
            "engine process %d: %d torch threads; API process: %d (of %d cores)",
            self.client.pid,
            self.engine_threads,
            self.api_threads,
            cores(),
        )

    @classmethod
    def start(cls, args: argparse.Namespace, config: EngineConfig) -> ModelLoad | None:
        """Started only when `serve` will get as far as loading (its early checks would pass);
        otherwise None, and the checks report the problem."""
        from engine.loading.model_source import resolve_model

        if args.expert_parallel and args.tensor_parallel_size < 2:
            return None
        if args.redis_url is None and shutil.which("redis-server") is None:
            return None
        try:
            resolve_model(args.model)
        except Exception:
            return None
        return cls(args, config)

    def imported(self) -> None:
        """The command's thread has done its imports (kept for the caller; the load is elsewhere)."""

    def finish(self, timeout_s: float = 30) -> None:
        """Stop the engine process if it still runs (an early exit, a failed startup)."""
        if self.client.alive:
            self.client.shutdown(timeout_s)

    def wait(self) -> Any:
        """The `LoadedModel` without its weights (blocks until loaded); raises `EngineStartFailed`."""
        return self.client.wait_phase("loaded")
