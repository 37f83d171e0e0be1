"""The scheduler over real KV tiers, without a model: multi-turn conversations under pressure.

`TierSim` drives a `Scheduler` whose pool is backed by a real (tiny) `KVCache`, with the real
`TieredStore` (host tier and/or a `RedisTier` on a real Redis) as its connector and the pool's
evictions going to it, as in the engine. "Running" a chunk writes into the request's pages,
for each token, a value that depends on every token up to it (as K and V do): so a page that
comes back from a tier and is used must hold exactly what recomputing it would write, and
`check_pages` verifies that for every page a request holds when it runs a chunk. The
conversations' turns are each the previous turn's prompt + output + new tokens, and what a
turn found cached (`Request.cached_tokens`, the count the API reports) is kept per turn.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.engine_config import EngineConfig
from engine.request import Request, RequestHandle
from engine.sampling_params import SamplingParams
from engine.scheduling.scheduler import ScheduledChunk, Scheduler
from kvstore.block_pool import BlockPool
from kvstore.codec import PageCodec
from kvstore.kv_cache import KVCache
from kvstore.prefix import Namespace
from kvstore.redis_tier import RedisTier
from kvstore.spec import KVSpec
from kvstore.tiers import TieredStore

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, page_size=16, dtype="float32")
NS = Namespace("SimForCausalLM", "cd" * 16, "float32", "float32", SPEC.page_size)
MOD = 1 << 20  # token values stay exact in float32


def prefix_values(tokens: list[int]) -> list[int]:
    """Per position, a value of all the tokens up to it (a rolling hash)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % MOD
        out.append(h)
    return out


@dataclass
class Turn:
    conversation: int
    index: int
    prompt: list[int]
    previous: int  # tokens of the previous turn's prompt + output (0 for a first turn)
    request: Request | None = None


class _Delayed:
    """A real fetch that reports ready only after `polls` more polls (a tier's latency)."""

    def __init__(self, fetch: Any, polls: int):
        self.fetch, self.polls = fetch, polls

    @property
    def offset(self) -> int:
        return int(self.fetch.offset)

    def ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0 and bool(self.fetch.ready())

    def take(self, expired: bool) -> int:
        n = int(self.fetch.take(expired))
        return 0 if expired and self.polls >= 0 else n

    def copy_into(self, pages: list[int]) -> None:
        self.fetch.copy_into(pages)

    def load(self, pages: list[int]) -> None:
        self.fetch.load(pages)

    def sources(self) -> tuple[int, int]:
        host, remote = self.fetch.sources()
        return int(host), int(remote)


class DelayedTier:
    """The real store with a simulated latency: each fetch is ready after `delay()` polls (0: at
    once, as host memory answers). Lookups are worth waiting for (a cost far below the Sim's
    recompute)."""

    def __init__(self, store: TieredStore, delay: Callable[[], int]):
        self.store, self.delay = store, delay
        self.fetches: list[_Delayed] = []

    def fetch(self, page_hashes: list[bytes], remote: bool = True) -> Any:
        f = self.store.fetch(page_hashes, remote)
        if f is None:
            return None
        polls = self.delay()
        if polls == 0:
            return f
        self.fetches.append(_Delayed(f, polls))
        return self.fetches[-1]

    def fetch_tail(self, *args: Any, **kw: Any) -> Any:
        return self.store.fetch_tail(*args, **kw)

    def fetch_cost_s(self, num_pages: int) -> float:
        return 1e-6 * num_pages

    def prefetch_pages(self) -> int:
        return self.store.prefetch_pages()

    def prefetch(self, page_hashes: list[bytes]) -> bool:
        return self.store.prefetch(page_hashes)

    def save(self, page_hashes: list[bytes], pages: list[int]) -> None:
        self.store.save(page_hashes, pages)

    def swap_out(self, page_hashes: list[bytes], pages: list[int]) -> int:
        return self.store.swap_out(page_hashes, pages)

    def touch(self, page_hashes: list[bytes], pages: list[int]) -> None:
        self.store.touch(page_hashes, pages)

    def evict(self, evicted: list[tuple[int, bytes]]) -> None:
        self.store.evict(evicted)


@dataclass
class TierSim:
    num_pages: int
    budget: int
    host_bytes: int = 0
    redis_url: str | None = None
    redis_prefix: str = "kv"
    max_num_seqs: int = 64
    recompute_s: Callable[[int], float] = lambda n: n / 1000.0
    lookup_timeout_s: float = 5.0
    delay: Callable[[], int] | None = None  # a simulated latency (in polls) before each fetch is ready
    prefetch_bytes: int = 0  # host memory that waiting requests' pages are read ahead into from Redis
    scheduler_kw: dict[str, object] = field(default_factory=dict)
    copy_ahead: int = 0  # pages the host tier copies ahead after each step (`TieredStore.copy_ahead`; 0: none)

    def __post_init__(self) -> None:
        self.kv = KVCache(SPEC, self.num_pages)
        codec = PageCodec(SPEC, NS.kv_dtype, NS.key)
        redis = RedisTier(self.redis_url, codec, 3600, self.redis_prefix) if self.redis_url else None
        self.store = TieredStore(self.kv, codec, self.host_bytes, redis, self.prefetch_bytes)
        self.connector: TieredStore | DelayedTier = self.store
        if self.delay is not None:
            self.connector = DelayedTier(self.store, self.delay)
        self.pool = BlockPool(self.num_pages, on_evict=self.connector.evict)
        config = EngineConfig(
            page_size=SPEC.page_size,
            max_num_batched_tokens=self.budget,
            max_num_seqs=self.max_num_seqs,
            kv_lookup_timeout_s=self.lookup_timeout_s,
        )
        self.sched = Scheduler(
            self.pool,
            config,
            namespace=NS,
            connector=self.connector,
            recompute_s=self.recompute_s,
            **self.scheduler_kw,  # type: ignore[arg-type]
        )
        self._values: dict[Request, list[int]] = {}
        self.progress: dict[Request, int] = {}  # tokens computed as of the last step that ran it
        self._was_running: set[Request] = set()
        self.readmitted: list[tuple[str, int, int]] = []  # (id, tokens it resumed at, tokens it had computed)
        self.steps = 0
        self.checked_pages = 0
        self.max_running = 0

    def close(self) -> None:
        self.store.close()

    def flush(self) -> None:
        if self.store.redis is not None:
            assert self.store.redis.flush(30.0), "Redis writes did not drain"

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, priority=priority), RequestHandle(rid, print))
        self.sched.add(req)
        return req

    def values(self, req: Request) -> list[int]:
        """`prefix_values` of the request's tokens, extended as it grows."""
        vals = self._values.setdefault(req, [])
        h = vals[-1] if vals else 0
        for i in range(len(vals), req.num_tokens):
            h = (h * 1_000_003 + req.token_at(i) + 1) % MOD
            vals.append(h)
        return vals

    def run_chunk(self, c: ScheduledChunk, values: list[int]) -> None:
        """Write the chunk's tokens' values into their pages (the 'forward pass')."""
        req, S = c.request, SPEC.page_size
        pos, end = req.num_computed, req.num_computed + c.num_tokens
        while pos < end:
            stop = min(end, (pos // S + 1) * S)
            vals = torch.tensor(values[pos:stop], dtype=torch.float32).view(1, -1, 1, 1)
            for layer in self.kv.layers:
                layer[req.pages[pos // S], :, pos % S : pos % S + stop - pos] = vals
            pos = stop

    def check_pages(self, req: Request, values: list[int]) -> None:
        """Every computed token in the request's live pages holds its value (restored or not)."""
        S = SPEC.page_size
        for i in range(req.pages.first, -(-req.num_computed // S)):
            n = min(S, req.num_computed - i * S)
            want = torch.tensor(values[i * S : i * S + n], dtype=torch.float32)
            for layer in self.kv.layers:
                got = layer[req.pages[i], :, :n, 0, 0]
                assert torch.equal(got, want.expand(2, n)), f"{req.id}: page {i} holds other KV"
            self.checked_pages += 1

    def step(self, token: Callable[[Request], int]) -> list[ScheduledChunk]:
        chunks = self.sched.schedule()
        for c in chunks:
            req = c.request
            assert req in self.sched.running
            assert len(req.pages) * SPEC.page_size >= req.num_computed + c.num_tokens, f"{req.id} lacks pages"
            values = self.values(req)
            if req.num_computed and c.num_tokens > 1:  # a restored or resumed prefill: its pages hold its KV
                self.check_pages(req, values)
            self.run_chunk(c, values)
        for c in chunks:
            req = c.request
            if req.num_preemptions and req not in self._was_running:  # back after a preemption
                self.readmitted.append((req.id, req.num_computed, self.progress.get(req, 0)))
            req.num_computed += c.num_tokens
            self.progress[req] = req.num_computed
        self.sched.computed([c.request for c in chunks])
        for c in chunks:
            if c.sample:
                req = c.request
                req.output_ids.append(token(req))
                if len(req.output_ids) >= req.params.max_tokens:
                    req.finished = True
                    self.sched.finish(req)
                    self._values.pop(req, None)
        self._was_running = set(self.sched.running)
        self.steps += 1
        self.max_running = max(self.max_running, len(self.sched.running))
        self.check_refcounts()
        if self.copy_ahead:  # the engine does it only while idle; between any two steps is harder
            self.store.copy_ahead(self.pool.next_evicted(1024), self.copy_ahead)
        if not chunks:
            time.sleep(0.0005)  # lookups on the tier's thread
        return chunks

    def check_refcounts(self) -> None:
        holders = list(self.sched.running) + [item.request for item in self.sched.loading]
        holders += [r for r in self.sched.waiting if r.pages]
        held = Counter(p for r in holders for p in r.pages)
        held.update(p for item in self.sched.loading for p in item.pages or ())
        assert all(self.pool.ref_counts[p] == n for p, n in held.items()), "reference counts drifted"
        assert self.pool.num_free == self.pool.num_pages - len(held)

    def run(self, reqs: list[Request], token: Callable[[Request], int], max_steps: int = 100_000) -> None:
        while any(not r.finished for r in reqs):
            assert self.steps < max_steps, f"stalled after {self.steps} steps"
            self.step(token)


def out_token(req: Request) -> int:
    """A request's output id: a function of its id and output position."""
    return (sum(map(ord, req.id)) * 31 + len(req.output_ids) * 7) % 997


def conversation_turns(
    sim: TierSim, prompts: list[list[int]], turns: int, new_tokens: Callable[[int, int], list[int]], max_tokens: int
) -> list[list[Turn]]:
    """Every conversation's turn t submitted at once, run to the end; then turn t + 1, whose
    prompt is turn t's prompt + output + `new_tokens(conversation, t + 1)`."""
    history: list[list[Turn]] = [[] for _ in prompts]
    current = [list(p) for p in prompts]
    previous = [0] * len(prompts)
    for t in range(turns):
        batch = []
        for c, prompt in enumerate(current):
            turn = Turn(c, t, prompt, previous[c])
            turn.request = sim.add(f"c{c}t{t}", prompt, max_tokens)
            history[c].append(turn)
            batch.append(turn.request)
        sim.run(batch, out_token)
        sim.flush()
        for c, turn in enumerate(h[-1] for h in history):
            assert turn.request is not None
            done = turn.prompt + turn.request.output_ids
            previous[c] = len(done)
            current[c] = done + new_tokens(c, t + 1)
    return history
