"""The API process's side of the engine process (`engine/process/main.py`).

`EngineClient` has the surface the session layer and routes use of an in-process `Engine`:
`add_request` (returning the same `RequestHandle`, iterated blocking or from asyncio),
`generate`, `abort`, `snapshot()`, `kv_stats()`, `stats.snapshot()`, `max_model_len`,
`capacity_tokens`, `alive`, `shutdown()`. Admission (`ContextTooLong`, `EngineOverloaded`,
`EngineClosed`) is decided here, synchronously, with the limits the engine reported; a request
counts as queued until the engine says it was scheduled (`wire.Outputs.started`).

A reader thread receives the engine's messages (`channel.Channel`: it sleeps in `poll`
without the GIL until the kernel has a frame) and hands each step's outputs to their handles,
until `read_on(loop)` hands the reading to an asyncio loop (the server's, once the engine is
built: `loop_reader.LoopReader`), which then wakes once a step instead of the thread and then
itself. When the engine process dies, every open request ends with an error and `on_death` is called
with the reason (the server then answers `/ready` 503 `engine_stopped` and exits 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.process import wire
from engine.process.channel import Channel, ChannelClosed
from engine.process.loop_reader import LoopReader
from engine.process.main import EngineInfo, LoadSpec
from engine.request import ConsumerGone, FinishReason, RequestHandle, RequestOutput, push_all
from engine.sampling_params import SamplingParams
from engine.scheduling.admission import Admission
from engine.snapshot import EngineSnapshot
from engine.stats import Histogram, StatsSnapshot
from engine.surface import Generates

log = logging.getLogger("longctx.engine")

# Seconds from the engine process sending a step's outputs to this process handing them over.
CHANNEL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class EngineStartFailed(RuntimeError):
    """A startup phase of the engine process failed (its message says which and why)."""


class EngineBadInput(EngineStartFailed, ValueError):
    """The engine process could not start on the model or options it was given (not found,
    unsupported, a bad checkpoint): the user's to fix, reported as `longctx: error: ...`."""


class _Stats:
    """`engine.stats` of the client: the engine's last `StatsSnapshot` (sent every 0.25 s)."""

    def __init__(self) -> None:
        self.last: StatsSnapshot | None = None

    def snapshot(self) -> StatsSnapshot:
        if self.last is None:
            from engine.stats import EngineStats

            return EngineStats().snapshot()
        return self.last


COMMIT_ANSWER_SLACK_S = 1.0  # past its own bound, how long a commit wait's answer may take to come back


class _CommitAnswer:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.written = False


class EngineClient(Generates):
    """Starts `python -m engine.process.main` and talks to it.

    Args:
        spec: what the engine process loads and builds.
        omp_wait_policy: `OMP_WAIT_POLICY` of the engine process; None: OpenMP's default (its
            workers spin a while between parallel regions, then sleep), whatever this process
            was given (the API process runs PASSIVE: `api/__init__.py`).
        on_death: called once (on the reader thread) if the engine process ends unasked.
    """

    def __init__(
        self, spec: LoadSpec, omp_wait_policy: str | None = None, on_death: Callable[[str], None] | None = None
    ):
        self.spec = spec
        self.on_death = on_death
        self._dir = tempfile.mkdtemp(prefix="longctx-core-")
        self._channel, theirs, signal = Channel.pair()
        spec_path = os.path.join(self._dir, "spec.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump(spec, f)
        env = dict(os.environ)
        env.pop("OMP_WAIT_POLICY", None)
        if omp_wait_policy:
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        if spec.threads:
            env["OMP_NUM_THREADS"] = str(spec.threads)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.process.main", spec_path, str(theirs.fileno()), str(signal)],
                env=env,
                start_new_session=True,
                pass_fds=(theirs.fileno(), signal),
            )
        finally:
            theirs.close()  # the engine process holds it now: its exit is this end's end of file
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}
        self._queued: set[str] = set()
        self._phases: dict[str, wire.Started] = {}
        self._phase_cv = threading.Condition(self._lock)
        self._commit_id = 0
        self._commits: dict[int, _CommitAnswer] = {}  # commit waits sent, by id
        self._stopped = threading.Event()
        self._closing = False
        self._dead: str | None = None
        self._failed: str | None = None  # the reason the engine process gave before exiting
        self._snapshot = EngineSnapshot()
        self.stats = _Stats()
        self._kv: dict[str, dict[str, int]] = {}
        self.host_bytes = 0
        self.prefetch_bytes = 0
        self.channel = Histogram(CHANNEL_BUCKETS)
        self.info: EngineInfo | None = None
        # The compiled step's report as the engine last sent it (None: eager, or not yet known);
        # `compiled` is set once every bucket is settled (or the engine is gone).
        self.compile_report: Any = None
        self.compiled = threading.Event()
        self.admission: Admission | None = None
        self.tokenizer: Any = None
        self.store = None  # the tiers live in the engine process (`host_bytes` has their size)
        self._handoff: asyncio.AbstractEventLoop | None = None  # `read_on`'s loop
        self._loop_reader: LoopReader | None = None
        self._read_here = False  # `shutdown` reads the rest on its own thread
        self._reader = threading.Thread(target=self._read, name="longctx-engine-reader", daemon=True)
        self._reader.start()

    # ---- startup ----

    def wait_phase(self, phase: str, timeout_s: float | None = None) -> Any:
        """The payload of the engine process's startup phase `phase` (blocks until it is done).

        Raises:
            EngineStartFailed: the phase failed, or the process ended first.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._phase_cv:
            while phase not in self._phases:
                if self._dead is not None or self._stopped.is_set():
                    raise EngineStartFailed(f"engine process ended before its {phase} phase: {self._dead}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise EngineStartFailed(f"engine process: no {phase} phase within {timeout_s} s")
                self._phase_cv.wait(0.1 if left is None else min(left, 0.1))
            msg = self._phases[phase]
        if msg.error is not None and msg.bad_input:
            raise EngineBadInput(msg.error)
        if msg.error is not None:
            raise EngineStartFailed(f"engine process, phase {phase}: {msg.error}")
        return pickle.loads(msg.payload)

    def build(
        self,
        kv_redis_url: str | None,
        kv_redis_prefix: str,
        enable_prefix_caching: bool = True,
        check_buckets: list[int] | None = None,
        background: bool = False,
    ) -> EngineInfo:
        """Build the engine (after `loaded`); returns what it reported, and admission opens.
        `check_buckets`: the compiled step's buckets to compile and self-check (None: all);
        `background`: compile them while serving (`compiled` is set when all are settled)."""
        self._send(wire.Build(kv_redis_url, kv_redis_prefix, enable_prefix_caching, check_buckets, background))
        info: EngineInfo = self.wait_phase("engine")
        self.info = info
        self.admission = Admission(
            info.config.max_queued, info.max_model_len, info.capacity_tokens, info.vocab_size, True
        )
        return info

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "build() first"
        return self.info.max_model_len

    @property
    def capacity_tokens(self) -> int:
        assert self.info is not None, "build() first"
        return self.info.capacity_tokens

    @property
    def config(self) -> Any:
        assert self.info is not None, "build() first"
        return self.info.config

    # ---- the caller's side (any thread) ----

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        matcher: Any = None,
        images: list[Any] | None = None,
    ) -> RequestHandle:
        """As `Engine.add_request`; the matcher crosses as its grammar's key and accepted tokens,
        images as their tensors' bytes (the engine process checks them against the prompt)."""
        admission = self.admission
        assert admission is not None, "build() first"
        params = params or SamplingParams()
        admission.check(prompt_token_ids, params)
        grammar = None
        if matcher is not None:
            key = getattr(matcher, "key", None)
            if key is None:
                raise ValueError("matcher: only a GrammarCompiler's matchers cross to the engine process")
            grammar = wire.GrammarSpec(key, list(getattr(matcher, "accepted", [])))
        admission.enter()
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        handle = RequestHandle(rid, self.abort)
        msg = wire.Add(rid, list(prompt_token_ids), params, cache_salt, grammar, wire.encode_images(images or []))
        with self._lock:
            duplicate = rid in self._handles
            if not duplicate:
                self._handles[rid] = handle
                self._queued.add(rid)
        if duplicate:
            admission.leave()
            handle.push(RequestOutput(rid, [], "", None, FinishReason.ERROR, len(prompt_token_ids), 0,
                                      f"request id {rid!r} already in use"))  # fmt: skip
            return handle
        try:
            admission.submit(lambda: self._send(msg))
        except BaseException:
            with self._lock:
                self._handles.pop(rid, None)
                self._queued.discard(rid)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request; safe from any thread and from async code (never blocks on the engine)."""
        with contextlib.suppress(ChannelClosed):
            self._send(wire.Abort(request_id))

    def _send(self, msg: Any) -> None:
        self._channel.send(wire.encoder.encode(msg))

    def kv_commit_wait(self, timeout_s: float) -> bool:
        """`Engine.kv_commit_wait` in the engine process: wait up to `timeout_s` until the KV pages
        queued for Redis so far are written (the rest are marked pending there). Blocks the
        calling thread (the session layer calls it through `asyncio.to_thread`); True at once
        without a Redis tier, False if the engine process is gone or does not answer in time."""
        if self.info is not None and getattr(self.info.config, "kv_redis_url", None) is None:
            return True
        if not self.alive:
            return False
        with self._lock:
            self._commit_id += 1
            wait_id = self._commit_id
            done = self._commits[wait_id] = _CommitAnswer()
        try:
            self._send(wire.CommitWait(wait_id, timeout_s))
            done.event.wait(timeout_s + COMMIT_ANSWER_SLACK_S)
            return done.written
        except ChannelClosed:
            return False
        finally:
            with self._lock:
                self._commits.pop(wait_id, None)

    def snapshot(self) -> EngineSnapshot:
        """The engine's load as of its last step's outputs; `queued` is this side's count."""
        queued = self.admission.queued if self.admission is not None else 0
        return dataclasses.replace(self._snapshot, queued=queued)

    def kv_stats(self) -> dict[str, dict[str, int]]:
        return self._kv

    @property
    def alive(self) -> bool:
        """Whether the engine process runs and has not been shut down."""
        return self._dead is None and not self._stopped.is_set() and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> EngineClient:
        return self

    # ---- the reader thread ----

    def _read(self) -> None:
        try:
            while True:
                loop = self._handoff
                if loop is not None:  # `read_on`: the loop reads from here on
                    try:
                        loop.call_soon_threadsafe(self._start_loop_reader, loop)
                        return
                    except RuntimeError:  # closed before it could start: read on here
                        self._handoff = None
                try:
                    frames = self._channel.recv(0.1)
                except ChannelClosed:  # the engine process ended (or closed its end): its exit code
                    frames = None
                for raw in frames or ():
                    if self._dispatch(raw):
                        return
                if frames is None or (not frames and self.proc.poll() is not None and not self._channel.wait(0)):
                    self._engine_ended()
                    return
        except Exception as e:  # a decoding bug: nothing more can be trusted from the channel
            log.exception("engine channel failed")
            self._died(f"the engine channel failed: {e}")
        finally:
            if self._closing and self._handoff is None:  # `shutdown` left the channel to this thread
                self._channel.close()

    def _dispatch(self, raw: bytes) -> bool:
        """Handle one message from the engine process; True when it said it stopped."""
        msg = wire.from_engine.decode(raw)
        if isinstance(msg, wire.Outputs):
            self._on_outputs(msg)
        elif isinstance(msg, wire.Metrics):
            self.stats.last, self._kv, self.host_bytes = msg.stats, msg.kv, msg.host_bytes
            self.prefetch_bytes = msg.prefetch_bytes
        elif isinstance(msg, wire.Compiled):
            self._on_compiled(pickle.loads(msg.payload))
        elif isinstance(msg, wire.Started):
            if msg.phase == "compiled" and msg.error is None:
                self._on_compiled(pickle.loads(msg.payload))
            with self._phase_cv:
                self._phases[msg.phase] = msg
                self._phase_cv.notify_all()
        elif isinstance(msg, wire.CommitDone):
            with self._lock:
                answer = self._commits.get(msg.id)
            if answer is not None:
                answer.written = msg.written
                answer.event.set()
        elif isinstance(msg, wire.Failed):
            self._failed = msg.reason
        elif isinstance(msg, wire.Stopped):
            self._stopped.set()
            self.compiled.set()
            return True
        return False

    def _engine_ended(self) -> None:
        """The channel's end: the engine process exited (or closed it) without saying it stopped."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        why = f": {self._failed}" if self._failed else ""
        self._died(f"the engine process exited with code {self.proc.returncode}{why}")

    # ---- reading on the event loop ----

    def read_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on `loop` (the server's) from now on, not on the reader
        thread: a step's outputs then wake this process once, not twice
        (`engine/process/loop_reader.py`). Blocking consumers (a thread iterating a handle,
        `wait_phase`, `kv_commit_wait`) go on working, served from the loop."""
        if self._handoff is not None or not self._reader.is_alive():
            return
        self._handoff = loop
        wake = self._channel.wake_fd
        if wake is not None:  # the reader thread sees it at once, not at its next 0.1 s poll
            with contextlib.suppress(OSError):
                os.eventfd_write(wake, 1)

    def _start_loop_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._stopped.is_set() or self._read_here:  # stopped, or `shutdown` reads on its thread
            return
        try:
            self._loop_reader = LoopReader(loop, self._channel, self.proc.pid, self._loop_frame, self._engine_ended)
            self._loop_reader.start()
        except OSError as e:  # the engine process is gone already (no pidfd)
            log.debug("engine channel on the loop: %s", e)
            self._engine_ended()

    def _loop_frame(self, raw: bytes) -> bool:
        try:
            return self._dispatch(raw)
        except Exception as e:
            log.exception("engine channel failed")
            if self._loop_reader is not None:
                self._loop_reader.stop()
            self._died(f"the engine channel failed: {e}")
            return False

    def _on_compiled(self, report: Any) -> None:
        self.compile_report = report
        if report is None or report.done:
            self.compiled.set()

    def _on_outputs(self, msg: wire.Outputs) -> None:
        self.channel.observe(max(0.0, time.monotonic() - msg.sent_at))
        self._snapshot = msg.snapshot
        left = 0
        pushes = []
        with self._lock:
            for rid in msg.started:
                if rid in self._queued:
                    self._queued.discard(rid)
                    left += 1
            for out in msg.outputs:
                rid = out.request_id
                handle = self._handles.get(rid)
                if out.finish_reason is not None:
                    self._handles.pop(rid, None)
                    if rid in self._queued:
                        self._queued.discard(rid)
                        left += 1
                if handle is not None:
                    pushes.append((handle, out))
        if left and self.admission is not None:
            self.admission.leave(left)
        for handle in push_all(pushes):  # their consumers' loops have closed
            if not handle.done:
                self.abort(handle.id)

    def _end_all(self, reason: FinishReason, error: str | None) -> None:
        with self._lock:
            handles, self._handles = self._handles, {}
            n = len(self._queued)
            self._queued.clear()
        if n and self.admission is not None:
            self.admission.leave(n)
        for rid, handle in handles.items():
            with contextlib.suppress(ConsumerGone):
                handle.push(RequestOutput(rid, [], "", None, reason, 0, 0, error))

    def _died(self, reason: str) -> None:
        self.compiled.set()  # nothing more will compile: a waiter goes on
        if self._closing:
            self._stopped.set()
            return
        self._dead = reason
        log.error("%s", reason)
        if self.admission is not None:
            self.admission.close()
        self._end_all(FinishReason.ERROR, reason)
        with self._phase_cv:
            self._phase_cv.notify_all()
            for answer in self._commits.values():  # a commit waiting for its pages goes ahead
                answer.event.set()
        if self.on_death is not None:
            try:
                self.on_death(reason)
            except Exception:
                log.exception("engine death callback failed")

    # ---- shutdown ----

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """End every open request (`abort`), stop the engine process and wait for it; kill it if
        it does not stop within `timeout_s` (a long forward pass in progress)."""
        if self._closing:
            return
        self._closing = True
        if self.admission is not None:
            self.admission.close()
        read_here = self._handoff is not None and not self._loop_can_read()
        if read_here:  # the loop took the reading over and cannot go on with it: this thread reads
            self._read_here = True
            if self._loop_reader is not None:
                self._loop_reader.stop()
        if self.proc.poll() is None:
            with contextlib.suppress(ChannelClosed):
                self._send(wire.Shutdown())
            if read_here:
                self._read_until_stopped(timeout_s)
            self._stopped.wait(timeout_s)
            try:
                self.proc.wait(max(1.0, timeout_s / 3))
            except subprocess.TimeoutExpired:
                log.error("the engine process did not stop; killing it")
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=2)
        if self._loop_reader is not None:
            self._loop_reader.stop()
        self._end_all(FinishReason.ABORT, None)
        if not self._reader.is_alive():  # else it ends on the closed socket's error
            self._channel.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _loop_can_read(self) -> bool:
        loop = self._handoff
        if loop is None or loop.is_closed() or not loop.is_running():
            return False
        try:
            return asyncio.get_running_loop() is not loop  # a blocking call on the loop stops it
        except RuntimeError:
            return True

    def _read_until_stopped(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._stopped.is_set() and time.monotonic() < deadline:
            try:
                frames = self._channel.recv(0.1)
            except ChannelClosed:
                return
            for raw in frames:
                if self._dispatch(raw):
                    return

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
