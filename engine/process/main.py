"""The engine core in a process of its own: `python -m engine.process.main SPEC FD SIGNAL_FD`.

The API process (`engine/process/client.py`) keeps HTTP, sessions and tokenization; this process
loads the model, builds the `Engine` and steps it in a busy loop, schedule -> forward -> sample,
on its main thread, with OpenMP free to spin (its `OMP_WAIT_POLICY` is set by the client, not
PASSIVE as in the API process). Requests and aborts arrive on the channel (`channel.Channel`, the
inherited socket `FD`; `SIGNAL_FD` is the eventfd it signals the API process's reader on),
drained between steps; each step's outputs leave in one message on it, with the load snapshot;
counters and histograms follow every `METRICS_INTERVAL_S`.

Startup, in order, each phase answered with `wire.Started`: `loaded` (the model; payload: the
`LoadedModel` without its weights), then on `wire.Build` (sent once the API process knows the
KV Redis URL) `engine` (payload: `EngineInfo`), then `compiled` (the compiled step's report, or
None). With `Build.background` the buckets compile in the background (`background_compile.py`):
`compiled` answers at once with every bucket pending, and a `wire.Compiled` follows each bucket
the loop switches in. A phase that fails answers with its error and the process exits 1. It also
exits when its parent goes away (Linux's parent-death signal, a check of the parent's pid, and the
channel's end of file: the API process closed it or died). On
`wire.Shutdown` it ends every open request with `abort`, sends them, then `wire.Stopped`.

Structured output: the request carries its grammar's key (`wire.GrammarSpec`); the matcher is
built here, where sampling happens, from a grammar compiled (and cached) here.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from engine.process.fetch_wake import FetchWake

log = logging.getLogger("longctx.engine")

METRICS_INTERVAL_S = 0.25
IDLE_POLL_MS = 100


@dataclass
class LoadSpec:
    """What the engine process builds, picklable (the client writes it to a file).

    Args:
        load: keyword arguments of `engine.loading.loader.load` (`spec` is the model).
        config: the engine's settings; `wire.Build` fills in the KV Redis tier.
        grammar: `module:attr` of a factory `(tokenizer, vocab_size) -> (GrammarHook, compile)`,
            where `compile(key)` returns a matcher for a grammar key (None: no structured output).
        check_compiled: compile and self-check every bucket of the compiled step after building.
        threads: torch's threads in this process (0: torch's default).
        log_level: of this process's `longctx` loggers (they write to the inherited stderr).
    """

    load: dict[str, Any]
    config: Any  # engine.engine_config.EngineConfig
    grammar: str | None = "tools.grammar:engine_grammar"
    check_compiled: bool = True
    threads: int = 0
    log_level: int = logging.INFO
    tensor_parallel_size: int = 1  # > 1: this process is rank 0 of a sharded engine (`engine/process/ranks.py`)
    expert_parallel: bool = False
    pipeline_parallel_size: int = 1  # stages, each of `tensor_parallel_size` ranks
    pipeline_layer_split: str = ""  # layers per stage, e.g. "10,10,12" ("": even)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineInfo:
    """What the API side needs of the built engine (admission limits, sizes)."""

    max_model_len: int
    capacity_tokens: int
    vocab_size: int
    page_size: int
    config: Any  # EngineConfig
    threads: int
    pid: int


class _Outbox:
    """Collects a step's outputs; the request handles of this process push here."""

    def __init__(self) -> None:
        self.items: list[Any] = []


def _handle_class() -> Any:
    from engine.request import RequestHandle

    class OutboxHandle(RequestHandle):
        def __init__(self, request_id: str, abort: Any, outbox: _Outbox):
            super().__init__(request_id, abort)
            self.outbox = outbox

        def push(self, out: Any) -> None:
            if self._closed:
                return
            self._closed = out.finish_reason is not None
            self.outbox.items.append(out)

    return OutboxHandle


class _CommitWaiter:
    """Answers `wire.CommitWait` on a thread of its own, so a turn's commit waiting for its KV
    pages never holds up the step loop."""

    def __init__(self, engine: Any, channel: Any):
        import queue
        import threading

        self.engine, self.channel = engine, channel
        self.waits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="longctx-commit-wait", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from engine.process import wire
        from engine.process.channel import ChannelClosed

        while (msg := self.waits.get()) is not None:
            try:
                written = self.engine.kv_commit_wait(msg.timeout_s)
            except Exception:  # the tier's trouble costs a recompute later, never the turn
                log.exception("KV commit wait failed")
                written = False
            try:
                self.channel.send(wire.encoder.encode(wire.CommitDone(msg.id, written)))
            except ChannelClosed:
                return

    def close(self) -> None:
        self.waits.put(None)
        self.thread.join(timeout=5)


class CoreLoop:
    """The engine process once its engine is built: drain the inbox, step, send the outputs."""

    def __init__(
        self, engine: Any, channel: Any, grammar: Any, parent: int, waiter: _CommitWaiter | None = None,
        compiler: Any = None, fetch_wake: FetchWake | None = None,
    ):  # fmt: skip
        from engine.process import wire

        self.engine = engine
        self.compiler = compiler  # a BackgroundCompile still switching buckets in, or None
        self.waiter = waiter
        self.fetch_wake = fetch_wake  # with a Redis tier: a lookup's end ends the loop's wait
        self.channel = channel
        self.grammar = grammar  # compile(key) -> matcher, or None
        self.parent = parent
        self.outbox = _Outbox()
        self.Handle = _handle_class()
        self.wire = wire
        self.unstarted: dict[str, Any] = {}  # request id -> Request, not yet scheduled
        self.stopping = False
        self._metrics_at = 0.0
        self._parent_at = 0.0

    def _add(self, msg: Any) -> None:
        from engine.request import FinishReason, RequestOutput

        matcher = None
        try:
            if msg.grammar is not None:
                if self.grammar is None:
                    raise ValueError("this engine has no grammar backend")
                matcher = self.grammar(msg.grammar.key, msg.grammar.accepted)
            handle = self.Handle(msg.request_id, self.engine.abort, self.outbox)
            images = self.wire.decode_images(msg.images) if msg.images else None
            self.engine.add_request(
                msg.prompt_ids, msg.params, request_id=msg.request_id, cache_salt=msg.cache_salt,
                matcher=matcher, handle=handle, images=images,
            )  # fmt: skip
        except Exception as e:  # the API side checked the same limits: this is unexpected
            log.warning("request %s refused in the engine process: %s", msg.request_id, e)
            self.outbox.items.append(
                RequestOutput(msg.request_id, [], "", None, FinishReason.ERROR, len(msg.prompt_ids), 0, str(e))
            )
            return
        self.unstarted[msg.request_id] = None

    def _drain(self, timeout_ms: int) -> None:
        wire = self.wire
        if timeout_ms and not self.channel.wait(timeout_ms / 1000):
            return
        for raw in self.channel.ready():
            msg = wire.to_engine.decode(raw)
            if isinstance(msg, wire.Add):
                self._add(msg)
            elif isinstance(msg, wire.Abort):
                self.engine.abort(msg.request_id)
            elif isinstance(msg, wire.CommitWait):
                if self.waiter is None:
                    written = self.engine.kv_commit_wait(msg.timeout_s)  # True at once without a Redis tier
                    self.channel.send(wire.encoder.encode(wire.CommitDone(msg.id, written)))
                else:
                    self.waiter.waits.put(msg)
            elif isinstance(msg, wire.Shutdown):
                self.stopping = True
                return

    def _started(self) -> list[str]:
        if not self.unstarted:
            return []
        reqs = self.engine._requests
        done = []
        for rid in self.unstarted:  # a step ran since it was added: gone from `_requests` = finished
            r = reqs.get(rid)
            if r is None or r.first_scheduled_time is not None:
                done.append(rid)
        for rid in done:
            del self.unstarted[rid]
        return done

    def _send(self) -> None:
        started = self._started()
        if any(out.finish_reason is not None for out in self.outbox.items):
            self._send_metrics()  # first: a consumer that sees its final output sees it counted
        if self.outbox.items or started:
            outs, self.outbox.items = self.outbox.items, []
            msg = self.wire.Outputs(outs, started, self.engine.snapshot(), time.monotonic())
            self.channel.send(self.wire.encoder.encode(msg))
        if time.monotonic() - self._metrics_at >= METRICS_INTERVAL_S:
            self._send_metrics()

    def _send_metrics(self) -> None:
        e = self.engine
        self._metrics_at = time.monotonic()
        host = e.store.host.num_bytes if e.store is not None else 0
        staged = e.store.staged.num_bytes if e.store is not None else 0
        self.channel.send(self.wire.encoder.encode(self.wire.Metrics(e.stats.snapshot(), e.kv_stats(), host, staged)))

    def run(self) -> None:
        """Serve until `wire.Shutdown`, the parent's death, or the channel's end (the API process
        closed it, or died: nothing sent could be read any more)."""
        from engine.process.channel import ChannelClosed

        try:
            self._serve()
        except ChannelClosed as e:
            log.error("the API process closed the channel (%s); the engine process exits", e)

    def _serve(self) -> None:
        e = self.engine
        while not self.stopping:
            busy = e.has_unfinished()
            self._drain(0 if busy or e.copy_ahead() else (2 if e.scheduler.loading else IDLE_POLL_MS))
            if self.stopping:
                break
            if e.has_unfinished():
                try:
                    stepped = e.step()
                except Exception as err:  # a bug outside any one request: fail those in flight
                    log.exception("engine step failed")
                    e._fail_all(f"engine error: {err}")
                    stepped = False
                if not stepped and e.scheduler.loading:  # a request waits for pages from a tier
                    if self.fetch_wake is not None:
                        self.fetch_wake.wait(2)  # until its lookup ends or a message comes in
                    else:
                        time.sleep(0.001)
            self._send()
            if self.compiler is not None and self.compiler.ready():  # one bucket per iteration
                self.compiler.switch_in()
                self.channel.send(self.wire.encoder.encode(self.wire.Compiled(pickle.dumps(self.compiler.report))))
                self.compiler = None if self.compiler.report.done else self.compiler
            now = time.monotonic()
            if now - self._parent_at > 1.0:
                self._parent_at = now
                if os.getppid() != self.parent:
                    log.error("the API process is gone; the engine process exits")
                    return
        e.shutdown()  # every open request ends with abort, pushed to the outbox
        self._send()
        self._send_metrics()
        self.channel.send(self.wire.encoder.encode(self.wire.Stopped()))


def _factory(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def main(argv: list[str]) -> int:
    spec_path, fd, signal_fd = argv
    parent = os.getppid()
    with open(spec_path, "rb") as f:
        spec: LoadSpec = pickle.load(f)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s"
    )
    logging.getLogger("longctx").setLevel(spec.log_level)
    from engine.process import ranks

    if ranks.is_worker(spec):  # rank 1..N-1 of a sharded engine: no channel, rank 0 drives it
        return ranks.worker_main(spec)
    from engine.process import wire
    from engine.process.channel import Channel, ChannelClosed

    channel = Channel.from_fd(int(fd), int(signal_fd))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop

    def started(phase: str, payload: Any = None, error: str | None = None, bad_input: bool = False) -> None:
        data = pickle.dumps(payload) if error is None else b""
        channel.send(wire.encoder.encode(wire.Started(phase, data, error, bad_input)))

    phase = "loaded"
    parallel: Any = None
    watchdog: Any = None
    runner: Any = None
    try:
        import torch

        if spec.threads:
            torch.set_num_threads(spec.threads)
        from engine.loading.loader import load

        parallel, watchdog = ranks.join(spec)
        if watchdog is not None:
            ranks.on_rank_failure(watchdog, channel)
        loaded = load(**spec.load, parallel=parallel)
        model = loaded.model
        started("loaded", replace(loaded, model=None))  # type: ignore[arg-type]  # its weights stay here
        build = None
        while build is None:
            if not channel.wait(0.5):
                if os.getppid() != parent:
                    return 1
                continue
            try:
                frames = channel.ready()
            except ChannelClosed:
                log.error("the API process closed the channel; the engine process exits")
                ranks.stop_workers(None, parallel, watchdog)
                return 1
            for i, raw in enumerate(frames):
                msg = wire.to_engine.decode(raw)
                if isinstance(msg, wire.Shutdown):
                    ranks.stop_workers(None, parallel, watchdog)
                    channel.send(wire.encoder.encode(wire.Stopped()))
                    channel.close(flush_s=5)
                    return 0
                if isinstance(msg, wire.Build):
                    build = msg
                    channel.put_back(frames[i + 1 :])  # what came after it is the loop's
                    break
        phase = "engine"
        config = replace(
            spec.config, kv_redis_url=build.kv_redis_url, kv_redis_prefix=build.kv_redis_prefix,
            enable_prefix_caching=build.enable_prefix_caching,
        )  # fmt: skip
        hook, grammar = None, None
        if spec.grammar:
            hook, grammar = _factory(spec.grammar)(loaded.tokenizer, loaded.config.vocab_size)
        from engine.engine import Engine

        if parallel.distributed:
            runner = ranks.driver_runner(model, config, parallel, watchdog)
        engine = Engine(
            model, loaded.tokenizer, config, grammar_hook=hook, fingerprint=loaded.stats.fingerprint,
            parallel=parallel, runner=runner,
        )  # fmt: skip
        info = EngineInfo(
            engine.max_model_len, engine.capacity_tokens, engine.model_config.vocab_size, engine.kv_spec.page_size,
            config, torch.get_num_threads(), os.getpid(),
        )  # fmt: skip
        started("engine", info)
        phase = "compiled"
        report, compiler = None, None
        if spec.check_compiled:
            from engine.model.compiled import CompiledStep
            from engine.process.background_compile import BackgroundCompile

            step = engine.runner.step
            buckets = None if build.check_buckets is None else tuple(build.check_buckets)
            if isinstance(step, CompiledStep) and build.background and not parallel.distributed:
                chosen = step.buckets if buckets is None else buckets  # (an empty list: none, as before)
                compiler = BackgroundCompile(step, engine.kv_spec.page_size, chosen, spec_path)
                report = compiler.report
            else:  # a sharded engine's ranks compile and check in step, before serving
                report = engine.runner.check_compiled(buckets)
        started("compiled", report)
    except Exception as e:
        from engine.loading.model_source import ModelNotFound
        from engine.loading.safetensors_file import CheckpointError
        from engine.model.config import UnsupportedModel

        if isinstance(e, (ModelNotFound, UnsupportedModel, CheckpointError, ValueError)):
            # the model or its options: the API process says it in one line, no traceback
            started(phase, error=str(e), bad_input=True)
        else:
            log.exception("engine process: phase %s failed", phase)
            started(phase, error=f"{type(e).__name__}: {e}")
        channel.close(flush_s=5)
        return 1  # the other ranks (if any) end when this process does: their watchdogs lose the store
    # Commit waits only have something to wait for with a Redis tier (without one the loop answers them at once).
    # A sharded engine's commit wait is a collective: it runs on the loop's thread, between steps.
    waiter = _CommitWaiter(engine, channel) if config.kv_redis_url and not parallel.distributed else None
    # With a Redis tier, lookups end on another thread: they wake the loop's wait.
    store = engine.store
    wake = FetchWake(channel, store) if store is not None and store.redis is not None else None
    try:
        CoreLoop(engine, channel, grammar, parent, waiter, compiler, wake).run()
    finally:
        if wake is not None:
            wake.close()
        if waiter is not None:
            waiter.close()
        if compiler is not None:
            compiler.close()
        ranks.stop_workers(runner, parallel, watchdog)
    channel.close(flush_s=5)
    return 0


if __name__ == "__main__":  # through the module's own name: what it pickles must unpickle as engine.process.main.*
    from engine.process import main as engine_main

    sys.exit(engine_main.main(sys.argv[1:]))
