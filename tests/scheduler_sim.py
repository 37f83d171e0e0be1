"""A stand-in for the model runner, to drive the `Scheduler` alone (no tensors, no model).

"Running" a chunk advances the request's `num_computed` and, when the chunk reaches the last
token, appends a token id that depends only on (request, output position), so a recomputed
request produces the same ids. Every step checks what `AttentionMetadata.build` and the
page pool rely on: each chunk's request is running and holds pages for `num_computed + n`
tokens (with a window: the pages its queries read are live, and no more than the window and the
chunk need), no request appears twice, waiting requests hold pages only while pinned (kept for
them after a lookup), and every page's reference count equals the number of requests (and
loading fetches) holding it.

`FakeConnector` stands in for the host and Redis tiers: it "has" the pages saved to it (or a
chosen set), and its fetches become ready after `polls` polls, or fail (find nothing). Its
fetches are always worth waiting for (a finite cost against the `Sim`'s endless recompute),
so the scheduler waits up to `lookup_timeout_s`, as the tests choose.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from engine.request import Request, RequestHandle
from engine.sampling_params import SamplingParams
from engine.scheduling.scheduler import ScheduledChunk, Scheduler
from kvstore.block_pool import BlockPool
from kvstore.prefix import Namespace, find_tail

NS = Namespace("SimForCausalLM", "ab" * 16, "float32", "float32", 16)
CONFIG_KEYS = ("max_num_seqs", "max_prefill_tokens_per_request", "lookup_timeout_s")  # `Sim`'s EngineConfig fields


@dataclass
class FakeFetch:
    found: int  # leading pages the connector has
    polls: int  # not ready for this many calls of ready()
    fail: bool  # the lookup errors out: nothing arrives
    loaded: int = 0
    taken: bool = False
    took: int = 0
    offset: int = 0

    def ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def take(self, expired: bool) -> int:
        assert not self.taken, "a fetch is taken once"
        self.taken = True
        if self.fail or (expired and self.polls >= 0):
            return 0
        self.took = self.found
        return self.found

    def copy_into(self, pages: list[int]) -> None:
        assert not self.taken

    def load(self, pages: list[int]) -> None:
        assert self.taken and len(pages) <= self.found
        self.loaded = len(pages)

    def sources(self) -> tuple[int, int]:
        return 0, self.took


@dataclass
class FakeConnector:
    """Args: polls: a fetch's delay in polls; fail_every: every n-th fetch fails (0 = never);
    keep_saved: pages offered to `save` are kept (a Redis that has what was computed)."""

    polls: int = 3
    fail_every: int = 0
    keep_saved: bool = True
    has: set[bytes] = field(default_factory=set)
    fetches: list[FakeFetch] = field(default_factory=list)

    def _leading(self, page_hashes: list[bytes]) -> int:
        n = 0
        while n < len(page_hashes) and page_hashes[n] in self.has:
            n += 1
        return n

    def fetch(self, page_hashes: list[bytes], remote: bool = True) -> FakeFetch | None:
        assert remote, "the Sim never finds recomputing cheaper"
        fail = self.fail_every > 0 and (len(self.fetches) + 1) % self.fail_every == 0
        f = FakeFetch(self._leading(page_hashes), self.polls, fail)
        self.fetches.append(f)
        return f

    def fetch_tail(
        self, page_hashes: list[bytes], first_needed: Callable[[int], int], beyond: int, remote: bool = True
    ) -> FakeFetch | None:
        """The window of the furthest resume point whose pages it has (`find_tail`)."""
        assert remote, "the Sim never finds recomputing cheaper"
        end = find_tail(len(page_hashes), first_needed, lambda i: page_hashes[i] in self.has, beyond)
        start = first_needed(end) if end > beyond else 0
        f = self.fetch(page_hashes[start:end] if end > beyond else [], remote)
        assert f is not None
        f.offset = start
        return f

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        if self.keep_saved:
            self.has.update(page_hashes)

    def fetch_cost_s(self, num_pages: int) -> float:
        return 1e6  # slow, but recomputing in the Sim is slower still: wait up to the timeout

    def prefetch_pages(self) -> int:
        return 0

    def prefetch(self, page_hashes: list[bytes]) -> bool:
        return False

    def swap_out(self, page_hashes: list[bytes], pages: list[int]) -> int:
        return 0

    def touch(self, page_hashes: list[bytes], pages: list[int]) -> None:
        return None

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        return None


def sim_token(req: Request) -> int:
    """The 'sampled' id: a function of the request and output position only."""
    return (sum(map(ord, req.id)) * 31 + len(req.output_ids) * 7) % 97


class Sim:
    """A scheduler over a pool of `num_pages`, stepped with invariant checks."""

    def __init__(self, num_pages: int, page_size: int, budget: int, *, check_pool: bool = True, **kw: object):
        self.pool = BlockPool(num_pages)
        self.page_size = page_size
        kw.setdefault("namespace", Namespace("SimForCausalLM", "ab" * 16, "float32", "float32", page_size))
        kw.setdefault("recompute_s", lambda num_tokens: math.inf)
        settings = {k: kw.pop(k) for k in CONFIG_KEYS if k in kw}
        if "lookup_timeout_s" in settings:
            settings["kv_lookup_timeout_s"] = settings.pop("lookup_timeout_s")
        config = EngineConfig(page_size=page_size, max_num_batched_tokens=budget, **settings)  # type: ignore[arg-type]
        self.sched = Scheduler(self.pool, config, **kw)  # type: ignore[arg-type]
        self.budget = budget
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.aborted: list[Request] = []
        self.steps = 0
        self.max_running = 0
        self.pool_checks = check_pool  # False: only plans are checked (to show a stall as a stall)

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0, salt: str = "") -> Request:
        params = SamplingParams(max_tokens=max_tokens, priority=priority)
        req = Request(rid, prompt, params, RequestHandle(rid, lambda _: None), cache_salt=salt)
        self.requests[rid] = req
        self.sched.add(req)
        return req

    def abort(self, req: Request) -> None:
        if not req.finished:
            req.finished = True
            self.sched.finish(req)
            self.aborted.append(req)

    def step(self) -> list[ScheduledChunk]:
        chunks = self.sched.schedule()
        self.check_plan(chunks)
        for c in chunks:
            c.request.num_computed += c.num_tokens
        self.sched.computed([c.request for c in chunks])
        for c in chunks:
            if c.sample:
                req = c.request
                req.output_ids.append(sim_token(req))
                if len(req.output_ids) >= req.params.max_tokens:
                    req.finished = True
                    self.sched.finish(req)
                    self.finished.append(req)
        self.steps += 1
        self.max_running = max(self.max_running, len(self.sched.running))
        if self.pool_checks:
            self.check_pool()
        return chunks

    def check_plan(self, chunks: list[ScheduledChunk]) -> None:
        assert sum(c.num_tokens for c in chunks) <= self.budget
        seen = set()
        for c in chunks:
            req = c.request
            assert req not in seen, f"{req.id} twice in one plan"
            seen.add(req)
            assert req in self.sched.running, f"{req.id} planned but not running (preempted?)"
            assert c.num_tokens >= 1
            assert req.num_computed + c.num_tokens <= req.num_tokens
            assert len(req.pages) * self.page_size >= req.num_computed + c.num_tokens, f"{req.id} lacks pages"
            # The pages the chunk's queries read are live (a window released only older ones) ...
            assert req.pages.first <= self.sched.first_needed(req.num_computed), f"{req.id} lost a window page"
            window = self.sched.window
            if window is not None:  # ... and no more are held than the window and the chunk cover
                bound = -(-(window + c.num_tokens - 1) // self.page_size) + 1
                assert req.pages.num_live <= bound, f"{req.id} holds {req.pages.num_live} pages > {bound}"
            assert c.sample == (req.num_computed + c.num_tokens == req.num_tokens)

    def holders(self) -> list[Request]:
        pinned = [r for r in self.sched.waiting if r in self.sched._pinned]
        return list(self.sched.running) + [item.request for item in self.sched.loading] + pinned

    def check_pool(self) -> None:
        for req in self.sched.waiting:
            assert not req.pages or req in self.sched._pinned, f"waiting {req.id} holds pages unpinned"
        assert all(r in self.sched.waiting and r.pages for r in self.sched._pinned), "pinned: waiting, with pages"
        held = Counter(p for r in self.holders() for p in r.pages)
        held.update(p for item in self.sched.loading for p in item.pages or ())
        assert all(self.pool.ref_counts[p] == n for p, n in held.items()), "reference counts drifted"
        assert self.pool.num_free == self.pool.num_pages - len(held)

    def drive(self, arrivals: list[tuple[int, str, list[int], int, int]], max_steps: int) -> None:
        """Add (step, id, prompt, max_tokens, priority) at their steps; step until no work is left."""
        pending = sorted(arrivals, key=lambda a: a[0])
        while pending or self.sched.has_work:
            while pending and pending[0][0] <= self.steps:
                _, rid, prompt, max_tokens, priority = pending.pop(0)
                self.add(rid, prompt, max_tokens, priority)
            assert self.steps < max_steps, f"stalled: {self.steps} steps"
            self.step()
