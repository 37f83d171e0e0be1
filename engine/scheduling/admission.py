"""What may enter the engine: a request that can fit, while fewer than `max_queued` wait.

`check` refuses at once what can never run (an empty prompt, a token outside the vocabulary,
prompt + max_tokens over the model's context or the KV capacity). `enter` is the one
admission limit, reused by the HTTP API: requests added and not yet running or finished
count against `max_queued`, and past it `EngineOverloaded` says when to retry. After `close`
nothing enters (`EngineClosed`). The caller's side (`check`, `enter`, `submit`) runs on any
thread; `track`/`started` run on the engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from engine.request import ContextTooLong, EngineClosed, EngineOverloaded, Request
from engine.sampling_params import SamplingParams


class Admission:
    def __init__(self, max_queued: int, max_model_len: int, capacity_tokens: int, vocab_size: int, has_tokenizer: bool):
        self.max_queued = max_queued
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.vocab_size = vocab_size
        self.has_tokenizer = has_tokenizer
        self._queued = 0  # added, not yet running or finished (any thread: under _lock)
        self._lock = threading.Lock()
        self._closing = threading.Lock()  # submit vs close: no request slips in after the last drain
        self._closed = False
        self._unstarted: set[Request] = set()  # engine thread: drained from the inbox, still counted

    @property
    def queued(self) -> int:
        return self._queued

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise at once for a request that can never run (ValueError naming the field)."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {self.vocab_size})")
        needed = len(prompt_token_ids) + params.max_tokens
        if needed > self.max_model_len:
            raise ContextTooLong(needed, self.max_model_len, "model's context")
        if needed > self.capacity_tokens:
            raise ContextTooLong(needed, self.capacity_tokens, "KV cache capacity")
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop: stop strings need a tokenizer")

    def enter(self) -> None:
        """Count one more queued request; `EngineOverloaded` past `max_queued`."""
        with self._lock:
            if self._queued >= self.max_queued:
                raise EngineOverloaded(self._queued, self.max_queued)
            self._queued += 1

    def leave(self, n: int = 1) -> None:
        with self._lock:
            self._queued -= n

    def submit(self, post: Callable[[], None]) -> None:
        """Run `post` (hand the request to the engine) unless closed; a refused request leaves."""
        with self._closing:
            if self._closed:
                self.leave()
                raise EngineClosed("the engine has been shut down")
            post()

    def close(self) -> None:
        with self._closing:
            self._closed = True

    def track(self, req: Request) -> None:
        """The engine thread took this request from its inbox; it counts until `started`."""
        self._unstarted.add(req)

    def started(self, reqs: Iterable[Request]) -> None:
        """These requests started running or finished: they no longer count against max_queued."""
        done = [r for r in reqs if r in self._unstarted]
        if done:
            self._unstarted.difference_update(done)
            self.leave(len(done))
