"""Continuous batching: which requests compute how many tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`). Running requests that decode
(one token each) are scheduled first, so a long prompt never stalls the streams already
generating; then prompts being prefilled continue in chunks; then waiting requests are
admitted while budget and pages last. When pages run out, the newest running request is
preempted: its pages go back to the pool and it is recomputed later from its tokens
(prompt + output so far), so nothing is lost or emitted twice.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.request import Request
from kvstore.block_pool import BlockPool


class ScheduledChunk(NamedTuple):
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed
    sample: bool  # the chunk reaches the request's last token: sample its next one


class Scheduler:
    def __init__(self, pool: BlockPool, page_size: int, max_num_batched_tokens: int = 512, max_num_seqs: int = 64):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.pool = pool
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # arrival order: the last is the first to be preempted
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, req: Request, n: int) -> int:
        return -(-(req.num_computed + n) // self.page_size) - len(req.pages)

    def _preempt(self, victim: Request) -> None:
        self.pool.free(victim.pages)
        victim.pages = []
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._pages_needed(req, n)
            while need > self.pool.num_free and self.running[-1] is not req:
                self._preempt(self.running[-1])
            if need > self.pool.num_free:
                self._preempt(req)
                continue
            req.pages += self.pool.allocate(need)
            chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._pages_needed(req, n)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            req.pages += self.pool.allocate(need)
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            budget -= n
        self.running.sort(key=lambda r: r.arrival)
        return chunks

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request's pages, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.pages)
        req.pages = []
