"""The serving loop's front: requests in, streamed tokens out, many requests per forward pass.

`Engine` is an `EngineCore` (`engine/core.py`: the parts and the step) with its caller's side
and its thread. `run_forever()` steps on its own thread; `add_request`, `generate` and `abort`
may be called from any thread or from async code: they post to the core's inbox, drained
between steps. `shutdown()` ends every open request with `FinishReason.ABORT`.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid

from engine.core import AbortRequest, EngineCore
from engine.distributed.kv_shards import ShardedConnector
from engine.engine_config import EngineConfig
from engine.model.vision.inputs import ImageInput
from engine.request import (
    FinishReason,
    Request,
    RequestHandle,
)
from engine.sampling.grammar import Matcher
from engine.sampling_params import SamplingParams
from engine.scheduling.images import RequestImages
from engine.surface import Generates

__all__ = ["Engine", "EngineConfig"]  # EngineConfig: its settings, imported from here too

log = logging.getLogger("longctx.engine")


class Engine(EngineCore, Generates):
    # ---- the caller's side (any thread) ----

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        matcher: Matcher | None = None,
        handle: RequestHandle | None = None,
        images: list[ImageInput] | None = None,
    ) -> RequestHandle:
        """Queue a request; raises ContextTooLong (or ValueError) at once if it can never run,
        EngineOverloaded past `max_queued`, EngineClosed after `shutdown()`. `handle`: where its
        outputs go (the engine process's handles send them on; its id must be `request_id`).
        `images`: a vision-language model's images, in the order of their placeholder runs in
        the prompt (`engine/loading/images.py` makes both)."""
        params = params or SamplingParams()
        self.admission.check(prompt_token_ids, params)
        request_images = self.request_images(prompt_token_ids, images)
        self.admission.enter()
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        handle = handle or RequestHandle(rid, self.abort)
        req = Request(
            rid, list(prompt_token_ids), params, handle, cache_salt=cache_salt, matcher=matcher, images=request_images
        )
        if self.tokenizer is not None:
            from engine.sampling.detokenizer import IncrementalDetokenizer, StopChecker

            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params.skip_special_tokens)
            req.stopper = StopChecker(params.stop)
        self.admission.submit(lambda: self._inbox.put(req))
        self._wake.set()
        return handle

    def request_images(self, prompt_token_ids: list[int], images: list[ImageInput] | None) -> RequestImages | None:
        """The images' placeholders in the prompt, checked (ValueError naming `images`); None for
        a request without images on a model whose prompts cannot hold any."""
        vision = self.model_config.vision
        if vision is None:
            if images:
                raise ValueError(f"images: the model ({self.model_config.architecture}) takes no image input")
            return None
        if not images and vision.image_token_id not in prompt_token_ids:
            return None
        return RequestImages.build(
            prompt_token_ids, list(images or ()), vision.image_token_id, bool(self.model_config.rope.mrope_section)
        )

    def abort(self, request_id: str) -> None:
        """Stop a request; safe from any thread and from async code (never blocks)."""
        self._inbox.put(AbortRequest(request_id))
        self._wake.set()

    # ---- the thread ----

    def run_forever(self) -> None:
        """The engine thread's loop: step while there is work, sleep until woken otherwise."""
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # a bug outside any one request: fail those in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(f"engine error: {e}")
                busy = False
            if not busy and not self.copy_ahead():
                self._wake.wait(timeout=0.002 if self.scheduler.loading else 0.5)
                self._wake.clear()

    @property
    def alive(self) -> bool:
        """Whether the loop's thread runs (False before `start`, after `shutdown`, or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Engine:
        """Run the loop on a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run_forever, name="longctx-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop the loop and end every open request with `FinishReason.ABORT`, so that every
        consumer (blocking or async) returns; `add_request` raises `EngineClosed` from now on."""
        self.admission.close()
        self._stop.set()
        self._wake.set()
        stuck = False
        if self._thread is not None:
            self._thread.join(timeout=10)
            stuck = self._thread.is_alive()
            self._thread = None
        if stuck:  # inside a forward pass: its state is not ours to touch, but no consumer may hang
            log.error("engine thread did not stop within 10 s; aborting its requests' outputs only")
            for req in list(self._requests.values()):
                self._push_final(req, FinishReason.ABORT)
        else:
            while True:  # requests never drained hold nothing yet: only their consumers to release
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Request):
                    self.admission.leave()
                    self._push_final(item, FinishReason.ABORT)
            for req in list(self._requests.values()):
                self._end(req, FinishReason.ABORT)
            self._publish()
        if self.store is not None:
            self.store.close()

    def kv_commit_wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until the KV pages queued for Redis so far are written (pages
        still queued then are marked pending: `kvstore.redis_writer.RedisWriter.commit_wait`).
        Any thread; True at once without a Redis tier."""
        if self.store is None or self.store.redis is None:
            return True
        if isinstance(self.connector, ShardedConnector):  # a collective: on the stepping thread only
            return self.connector.commit_wait(timeout_s)
        return self.store.redis.commit_wait(timeout_s)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
