"""The engine's core: its parts (runner, KV cache and tiers, pool, scheduler, sampler) and the
step that drives them, schedule -> run -> sample -> postprocess, on whichever thread steps.

Requests and aborts arrive through `_inbox` (posted by `Engine` from any thread) and are drained
at the start of each step, so the core owns all its state. A failure tied to one request (its
grammar dead-ends or raises, its consumer's event loop has closed, its sampling or detokenizing
raises) ends that request alone with `FinishReason.ERROR` and a message; the others go on. Only
a fault of the forward pass fails the whole step, and then every request gets an error output:
none is left hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time

import torch

from engine.distributed.kv_shards import ShardedConnector, ShardOps
from engine.distributed.parallel import SINGLE, ParallelContext
from engine.engine_config import EngineConfig
from engine.kv_connector import KVConnector, NoConnector
from engine.kv_tiers import build_tiers, kv_namespace, kv_stats, reclaim_window
from engine.loading.tokenizer import Tokenizer
from engine.model.config import ModelConfig
from engine.model.model import CausalLM
from engine.model.vision.step import ChunkImages
from engine.model_runner import Chunk, ModelRunner
from engine.request import (
    ConsumerGone,
    FinishReason,
    Request,
    RequestOutput,
)
from engine.sampling.grammar import GrammarHook
from engine.sampling.output_processor import OutputProcessor
from engine.sampling.sampler import Sampler
from engine.scheduling.admission import Admission
from engine.scheduling.encoder_cache import EncoderCache
from engine.scheduling.images import ImageFeeder
from engine.scheduling.prefill_rate import PrefillRate
from engine.scheduling.scheduler import ScheduledChunk, Scheduler
from engine.snapshot import EngineSnapshot
from engine.stats import EngineStats
from kvstore.block_pool import BlockPool
from kvstore.tiers import TieredStore

log = logging.getLogger("longctx.engine")

# Copying ahead into the host tier while idle (`EngineCore.copy_ahead`): the free-list entries
# looked at per batch, and a batch's bytes (a request arriving meanwhile waits for one batch:
# ~1-3 ms for 4 MiB on a 2-core EPYC).
COPY_AHEAD_SCAN = 1024
COPY_AHEAD_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class AbortRequest:
    """An inbox message: end this request (a new request arrives as its `Request`)."""

    request_id: str


class EngineCore:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer | None,
        config: EngineConfig | None = None,
        *,
        parallel: ParallelContext = SINGLE,
        connector: KVConnector | None = None,
        grammar_hook: GrammarHook | None = None,
        fingerprint: str = "",
        runner: ModelRunner | None = None,
    ):
        """Args:
        fingerprint: digest of the weights (`LoadStats.fingerprint`); part of the KV namespace,
            required by the Redis tier (pages are shared only between identical weights).
        runner: runs the forward passes over its own KV cache (e.g. a `DistributedRunner` that
            broadcasts each step to the other ranks); by default a `ModelRunner` sized by `config`.
        """
        self.model = model
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.parallel = parallel
        if parallel.distributed and connector is not None:
            raise ValueError("a sharded engine builds its own KV connector (each rank keeps its slices)")
        self.grammar_hook = grammar_hook or GrammarHook()
        if config.threads:
            torch.set_num_threads(config.threads)
        if runner is None:
            runner = ModelRunner.for_model(model, config.page_size, config.kv_cache_bytes, config.attention_backend)
        if config.compile:
            from engine.compiled_runner import attach

            attach(runner, config.compile_buckets)
        self.runner = runner
        self.kv_cache = runner.kv_cache
        self.kv_spec = runner.kv_cache.spec  # this rank's heads
        assert self.kv_spec.page_size == config.page_size, "the runner's KV cache has another page size"
        self.namespace = kv_namespace(model, self.kv_spec, config.kv_dtype, fingerprint, parallel)
        self.store: TieredStore | None = None
        if connector is None and (config.host_cache_bytes or config.kv_redis_url):
            connector = self.store = build_tiers(self.kv_cache, self.namespace, config)
            if parallel.distributed:  # every rank keeps its slices; rank 0 decides what is usable
                ops = getattr(runner, "ops", None)
                if not isinstance(ops, ShardOps):
                    raise ValueError("the KV tiers of a sharded engine need its DistributedRunner")
                connector = ShardedConnector(self.store, ops)
        self.connector: KVConnector = connector or NoConnector()
        self.pool = BlockPool(self.kv_cache.num_pages, on_evict=self.connector.evict)
        # what recomputing costs, against a tier lookup's wait: measured, or the configured rate
        fixed = config.recompute_tokens_per_s
        self.prefill_rate = PrefillRate(fixed, fixed=True) if fixed else PrefillRate()
        self.reclaim_window = reclaim_window(self.model_config)
        self.scheduler = Scheduler(
            self.pool,
            config,
            namespace=self.namespace if config.enable_prefix_caching else None,
            connector=self.connector,
            recompute_s=self.prefill_rate.seconds,
            window=self.reclaim_window,
        )
        # A vision-language model's images: encoded once each, kept by content hash.
        self.images: ImageFeeder | None = None
        if model.vision is not None:
            device = model.model.norm.weight.device
            self.images = ImageFeeder(model.vision, EncoderCache(config.encoder_cache_bytes), device)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.eos_token_ids = set(tokenizer.eos_token_ids if tokenizer else self.model_config.eos_token_ids)
        self.output_processor = OutputProcessor(self.sampler, self.grammar_hook, self.eos_token_ids, self.stats)
        self._requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue[Request | AbortRequest] = queue.SimpleQueue()
        self._wake = threading.Event()
        if self.store is not None:  # a finished tier lookup wakes the loop: its request is admitted at once
            self.store.on_fetched = self._wake.set
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.admission = Admission(
            config.max_queued,
            self.max_model_len,
            self.capacity_tokens,
            self.model_config.vocab_size,
            has_tokenizer=tokenizer is not None,
        )
        self._snapshot = EngineSnapshot(free_pages=self.pool.num_free, total_pages=self.pool.num_pages)
        pages, page_size = self.kv_cache.num_pages, self.kv_spec.page_size
        log.info(
            "KV cache: %d pages x %d tokens = %d tokens (%.1f MB, %s); backend %s",
            pages,
            page_size,
            pages * page_size,
            self.kv_cache.num_bytes / 1e6,
            self.kv_spec.dtype,
            runner.backend.name,
        )
        self._log_windows()

    def _log_windows(self) -> None:
        windows = self.model_config.sliding_windows
        if self.reclaim_window is not None:
            log.info(
                "every layer has a sliding window (at most %d tokens): a sequence releases its KV pages "
                "behind the window as it advances and holds at most %d pages between steps",
                self.reclaim_window,
                -(-self.reclaim_window // self.kv_spec.page_size) + 2,
            )
        elif windows:
            full = sum(w is None for w in windows)
            log.info(
                "the model mixes full-attention (%d) and sliding-window (%d) layers: every KV page is kept, "
                "since the full-attention layers read them all",
                full,
                len(windows) - full,
            )

    @property
    def capacity_tokens(self) -> int:
        """The longest request (prompt + max_tokens) the KV cache can hold: its tokens, or, when
        every layer has a window and the pool holds a window plus a full step's chunk, the
        model's context (a sequence then keeps only its window's pages)."""
        pool_tokens = self.kv_cache.num_pages * self.kv_spec.page_size
        w = self.reclaim_window
        if (
            w is not None
            and self.kv_cache.num_pages >= self.kv_spec.pages_for(w + self.config.max_num_batched_tokens) + 2
        ):
            return max(pool_tokens, self.max_model_len)
        return pool_tokens

    # ---- the caller's side (any thread) ----

    # ---- the loop (the stepping thread) ----

    def step(self) -> bool:
        """One step: schedule -> run -> sample -> postprocess. Returns False when idle."""
        self._drain_inbox()
        chunks = self.scheduler.schedule()
        self.admission.started(c.request for c in chunks)
        self.stats.preemptions = self.scheduler.num_preemptions
        if not chunks:
            self._publish()
            return False
        self._note_scheduled(chunks)
        inputs = self._image_inputs(chunks)
        chunks = [c for c in chunks if not c.request.finished]  # a request whose image failed has ended
        if not chunks:
            self._publish()
            return True
        try:
            logits = self._run(chunks, inputs)
        except Exception as e:  # a fault of the model itself: nothing of this step can be trusted
            log.exception("forward pass failed")
            self._fail_all(f"engine error in the forward pass: {e}")
            self._publish()
            return True
        self.scheduler.computed([c.request for c in chunks])
        if self.images is not None:
            for c in chunks:
                if c.request.images is not None:
                    self.images.computed(c.request, c.request.images, c.request.num_computed)
        rows = [i for i, c in enumerate(chunks) if c.sample]
        reqs = [chunks[i].request for i in rows]
        outs = self.output_processor(reqs, logits[rows]) if rows else []
        for r, out in zip(reqs, outs, strict=True):
            if out.finish_reason is not None:
                self._finish(r, out.finish_reason)
        self.stats.steps += 1
        self._publish()  # before the outputs: a consumer that sees its final output sees it counted
        self._push(reqs, outs)
        return True

    def _note_scheduled(self, chunks: list[ScheduledChunk]) -> None:
        now = time.monotonic()
        for c in chunks:
            r = c.request
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
                self.stats.queue_time.observe(now - r.arrival)

    def _image_inputs(self, chunks: list[ScheduledChunk]) -> dict[Request, ChunkImages]:
        """Each chunk's image features (encoded now if not cached) and M-RoPE positions; a request
        whose image cannot be encoded ends with an error, the others go on."""
        inputs: dict[Request, ChunkImages] = {}
        if self.images is None:
            return inputs
        for c in chunks:
            r = c.request
            if r.images is None:
                continue
            try:
                got = self.images.chunk(r, r.images, r.num_computed, r.num_computed + c.num_tokens)
            except Exception as e:
                log.exception("request %s: encoding its images failed", r.id)
                self._fail(r, f"encoding the request's images failed: {e}")
                continue
            if got is not None:
                inputs[r] = got
        return inputs

    def _run(self, chunks: list[ScheduledChunk], inputs: dict[Request, ChunkImages] | None = None) -> torch.Tensor:
        batch = []
        for c in chunks:
            r = c.request
            end = r.num_computed + c.num_tokens
            images = inputs.get(r) if inputs else None
            batch.append(Chunk(r.tokens(r.num_computed, end), r.pages.live(), end, r.pages.first, images))
            if r.num_computed < len(r.prompt_ids):
                self.stats.prompt_tokens_computed += min(end, len(r.prompt_ids)) - r.num_computed
        t0 = time.perf_counter()
        logits = self.runner.run(batch)  # [B, V]
        if any(c.num_tokens > 1 for c in chunks):
            self.prefill_rate.observe(sum(c.num_tokens for c in chunks), time.perf_counter() - t0)
        for c in chunks:
            c.request.num_computed += c.num_tokens
        return logits

    def _push(self, reqs: list[Request], outs: list[RequestOutput]) -> None:
        """Hand each request its output; a request whose consumer is gone ends with an error."""
        gone = False
        for r, out in zip(reqs, outs, strict=True):
            try:
                r.handle.push(out)
            except ConsumerGone as e:
                self._fail(r, str(e))
                gone = True
        if gone:
            self._publish()

    def _finish(self, r: Request, reason: FinishReason) -> None:
        if r.finished:
            return
        r.finished = True
        self.admission.started([r])
        self._requests.pop(r.id, None)
        self.stats.count_finished(reason.value)
        self.stats.e2e.observe(time.monotonic() - r.arrival)
        self.scheduler.finish(r)
        if self.images is not None and r.images is not None:
            self.images.finish(r, r.images)

    def _end(self, r: Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish a request with a final output carrying no token."""
        self._finish(r, reason)
        self._push_final(r, reason, error)

    def _fail(self, r: Request, error: str) -> None:
        log.warning("request %s failed: %s", r.id, error)
        self._end(r, FinishReason.ERROR, error)

    def _fail_all(self, error: str) -> None:
        for req in list(self._requests.values()):
            self._end(req, FinishReason.ERROR, error)

    @staticmethod
    def _push_final(r: Request, reason: FinishReason, error: str | None = None) -> None:
        out = RequestOutput(r.id, [], "", None, reason, len(r.prompt_ids), r.cached_tokens, error)
        with contextlib.suppress(ConsumerGone):  # queued all the same; nobody is left to wake
            r.handle.push(out)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, AbortRequest):
                req = self._requests.get(item.request_id)
                if req is not None:
                    self._end(req, FinishReason.ABORT)
                continue
            self.admission.track(item)
            if item.id in self._requests:
                self.admission.started([item])
                self._push_final(item, FinishReason.ERROR, f"request id {item.id!r} already in use")
                continue
            self._requests[item.id] = item
            self.scheduler.add(item)

    def _publish(self) -> None:
        s, st = self.scheduler, self.stats
        self._snapshot = EngineSnapshot(
            running=len(s.running),
            waiting=len(s.waiting),
            loading=len(s.loading),
            queued=self.admission.queued,
            free_pages=self.pool.num_free,
            total_pages=self.pool.num_pages,
            preemptions=s.num_preemptions,
            prompt_tokens_computed=st.prompt_tokens_computed,
            generated_tokens=st.generated_tokens,
            finished=st.finished,
            steps=st.steps,
            request_pages={
                r.id: r.pages.num_live for r in itertools.chain(s.running, (i.request for i in s.loading), s.pinned)
            },
            peak_request_pages=s.peak_request_pages,
            reclaimed_pages=s.num_reclaimed_pages,
        )

    def snapshot(self) -> EngineSnapshot:
        """The load as of the last step (any thread): an immutable copy the engine thread replaces
        after each step, so no caller reads the scheduler's lists while they change. `queued` is
        read live: it is what `add_request` checks, and an idle engine publishes no step while a
        request added and aborted at once still counts until the engine thread drains it."""
        return dataclasses.replace(self._snapshot, queued=self.admission.queued)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or not self._inbox.empty()

    def run_until_idle(self) -> None:
        """Step on the calling thread until every request has finished."""
        while self.has_unfinished():
            try:
                busy = self.step()
            except Exception as e:
                self._fail_all(f"engine error: {e}")
                raise
            if not busy and self.scheduler.loading:  # a request waits for KV pages from a tier
                self._wake.wait(0.002)  # set when its lookup ends (or a request comes in)
                self._wake.clear()

    def copy_ahead(self) -> bool:
        """While idle (nothing to run): copy a batch of the free device pages next in line for
        reuse into the host tier (`TieredStore.copy_ahead`), so that the next turn's allocation
        evicts them without copying. True if it copied any (the caller polls again at once, so a
        request arriving waits at most one batch); False when there is nothing left to copy, no
        host tier, or the tiers are sharded (each rank copies its slices at eviction)."""
        store = self.store
        if store is None or self.connector is not store or store.host.budget_bytes == 0:
            return False
        if self.has_unfinished():  # a request arrived, runs, or waits for a tier's pages
            return False
        batch = max(1, COPY_AHEAD_BYTES // self.kv_spec.bytes_per_page)
        return store.copy_ahead(self.pool.next_evicted(COPY_AHEAD_SCAN), batch) > 0

    def kv_stats(self) -> dict[str, dict[str, int]]:
        """Counters of the prefix cache and the KV tiers."""
        return kv_stats(self.pool, self.scheduler, self.store)
