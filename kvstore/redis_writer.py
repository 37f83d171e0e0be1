"""The write-behind side of the Redis KV tier: a thread that stores pages and keeps them alive.

`save` only queues a snapshot of the pages; the writer thread encodes them (header +
checksum, int8 if asked) and sends them in pipelines of `SET ... EX ttl` of at most
`BATCH_BYTES`, usually within milliseconds of the page filling. The queue is bounded in
bytes (`max_pending_bytes`): past it new pages are dropped, never waited for. Until a page's
`SET` has answered, lookups read the queued copy (`PageLedger`): a request that comes back
within milliseconds finds its pages all the same.

Lifetime: a page's TTL is refreshed (pipelined `EXPIRE`) whenever the engine uses it again,
at most once per `refresh_s`, so a conversation in use never expires. An `EXPIRE` that finds
no key (expired, evicted, lost in an outage) asks `rewrite` for a copy of the page (the store
still holds it in device memory) and writes it again at once.

A pipeline that fails whole on a stalled server (paused or busy past the socket timeout)
is sent again with backoff for up to `RESEND_WINDOW_S`: `SET` is
idempotent and the pages are still queued, so a pause longer than the socket timeout loses
nothing. A pipeline whose commands fail (out of memory under `noeviction`), or one still
failing after the window, turns writes off for `retry_s` with one warning; reads are the
reader's business and go on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import redis
import torch

from kvstore.codec import PageCodec
from kvstore.page_ledger import PageLedger
from kvstore.transfer_estimate import TransferEstimate

log = logging.getLogger("longctx.kv.redis")

BATCH_BYTES = 8 << 20  # most bytes per pipeline or MGET
MAX_REFRESH_S = 60.0  # a used page's TTL is refreshed at most this often (and at most every TTL / 3)
TRACKED_PAGES = 1 << 18  # pages whose last refresh is remembered, LRU
RESEND_WINDOW_S = 30.0  # how long a pipeline that timed out on a stalled server is sent again


@dataclass(slots=True)
class RedisCounters:
    written: int = 0  # pages stored
    write_failures: int = 0  # failed pipelines (each drops what it did not store)
    dropped: int = 0  # pages not written: queue full or writes down
    found: int = 0  # pages read back and verified
    loaded: int = 0  # of those, pages copied into device memory
    missing: int = 0  # lookups that stopped at an absent key
    bad_pages: int = 0  # values rejected by the codec (damaged, truncated, foreign)
    read_failures: int = 0  # failed MGETs
    refreshed: int = 0  # TTLs refreshed on use
    absent: int = 0  # used pages whose key was gone when refreshed
    rewritten: int = 0  # of those, pages written again from device memory
    commit_waits: int = 0  # turn commits that waited for their pages (`commit_wait`)
    commit_wait_timeouts: int = 0  # of those, waits that ended at the bound (pages marked pending)
    pending_marked: int = 0  # pages marked pending in Redis at such a bound
    pending_waited: int = 0  # lookups that found a pending mark and waited for the page
    queue_hits: int = 0  # pages a lookup took from the writer's queue (not yet written)
    swapped_out: int = 0  # pages handed to the writer when their request was preempted


class _Save(NamedTuple):
    hashes: list[bytes]
    pages: torch.Tensor  # [N, L, 2, P, H, D] model dtype, a copy
    num_bytes: int
    seq: int = 0  # the order it was queued in (`commit_wait`)


class _Touch(NamedTuple):
    hashes: list[bytes]


class RedisWriter:
    """Args:
    client: the writer's connection (its socket timeout bounds a stalled write).
    codec: page encoding for this model and storage dtype.
    key: the Redis key of a page hash.
    ttl_s: expiry of every page key, refreshed on use.
    max_pending_bytes: most bytes of page copies waiting to be written.
    counters, link: shared with the reader (one set of counters, one estimate of the link).
    retry_s: how long a failure keeps writes off.
    """

    def __init__(
        self,
        client: redis.Redis,
        codec: PageCodec,
        key: Callable[[bytes], str],
        ttl_s: int,
        max_pending_bytes: int,
        counters: RedisCounters,
        link: TransferEstimate,
        retry_s: float = 5.0,
    ):
        self.client = client
        self.codec = codec
        self.key = key
        self.ttl_s = ttl_s
        self.refresh_s = min(MAX_REFRESH_S, ttl_s / 3)
        self.max_pending_bytes = max_pending_bytes
        self.counters = counters
        self.link = link
        self.retry_s = retry_s
        self.value_bytes = codec.payload_len + 128  # the payload and a header of about 100 bytes
        self._queue: queue.Queue[_Save | _Touch | None] = queue.Queue()
        self._pending_bytes = 0
        self._pending_items = 0
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._closing = False
        self._refreshed: OrderedDict[bytes, float] = OrderedDict()  # page -> last write or refresh
        # Called on the writer thread with pages found gone on refresh: a copy of those still
        # at hand, (hashes, pages [N, L, 2, P, H, D]), to write again, or None.
        self.rewrite: Callable[[list[bytes]], tuple[list[bytes], torch.Tensor] | None] | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._queued_seq = 0  # of the last save queued
        self._done = threading.Condition(self._lock)
        self._done_seqs: set[int] = set()  # saves written or dropped, above _done_below
        self._done_below = 1  # every save with a lower seq is done
        self._queued: dict[int, list[bytes]] = {}  # seq -> hashes of saves not yet done
        self.ledger = PageLedger()  # queued pages (readable by lookups) and pages known stored
        self._thread = threading.Thread(target=self._write_loop, name="longctx-kv-writer", daemon=True)
        self._thread.start()

    def writable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, e: Exception) -> None:
        was_up = self.writable()
        self._down_until = time.monotonic() + self.retry_s
        if was_up:
            log.warning("KV Redis writes off for %.0f s (%s); lookups go on", self.retry_s, e)

    def save(self, page_hashes: list[bytes], pages: torch.Tensor) -> bool:
        """Queue pages [N, L, 2, P, H, D] (a copy, model dtype) for writing; never blocks.
        False if they were dropped (queue full, writes down)."""
        num_bytes = pages.numel() * pages.element_size()
        with self._lock:
            if not self.writable() or self._pending_bytes + num_bytes > self.max_pending_bytes:
                self.counters.dropped += len(page_hashes)
                return False
            self._pending_bytes += num_bytes
            self._pending_items += 1
            self._idle.clear()
            now = time.monotonic()
            for h in page_hashes:  # a SET starts a fresh TTL
                self._remember(h, now)
            self._queued_seq += 1
            seq = self._queued_seq
            self._queued[seq] = page_hashes
            self.ledger.queue(seq, page_hashes, pages)
        self._queue.put(_Save(page_hashes, pages, num_bytes, seq))
        return True

    def touch(self, page_hashes: list[bytes]) -> None:
        """These pages were used again: refresh the TTL of those not refreshed for `refresh_s`
        (on the writer thread; never blocks)."""
        if not page_hashes or not self.writable():
            return
        now = time.monotonic()
        due = []
        with self._lock:
            for h in page_hashes:
                last = self._refreshed.get(h)
                if last is None or now - last >= self.refresh_s:
                    self._remember(h, now)
                    due.append(h)
            if not due:
                return
            self._pending_items += 1
            self._idle.clear()
        self._queue.put(_Touch(due))

    def _remember(self, h: bytes, now: float) -> None:
        self._refreshed[h] = now
        self._refreshed.move_to_end(h)
        if len(self._refreshed) > TRACKED_PAGES:
            self._refreshed.popitem(last=False)

    def _write_loop(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.ping()  # connect before the first write
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            size = item.num_bytes if isinstance(item, _Save) else 0
            while size < BATCH_BYTES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
                size += nxt.num_bytes if isinstance(nxt, _Save) else 0
            saves = [b for b in batch if isinstance(b, _Save)]
            touches = [h for b in batch if isinstance(b, _Touch) for h in b.hashes]
            stored: list[bool] = []
            try:
                stored = self._write(saves)
                self._refresh(touches)
            except Exception as e:  # never let the writer thread die
                log.exception("KV writer: %s", e)
            stored += [False] * (sum(len(b.hashes) for b in saves) - len(stored))  # cut short: not stored
            start = 0
            for b in saves:  # out of the queue only now: a lookup meets each page in one or the other
                self.ledger.settle(b.seq, b.hashes, stored[start : start + len(b.hashes)])
                start += len(b.hashes)
            with self._lock:
                self._pending_bytes -= size
                self._pending_items -= len(batch)
                if self._pending_items == 0:
                    self._idle.set()
                for b in saves:
                    if b.seq:
                        self._queued.pop(b.seq, None)
                        self._done_seqs.add(b.seq)
                while self._done_below in self._done_seqs:
                    self._done_seqs.discard(self._done_below)
                    self._done_below += 1
                self._done.notify_all()

    def _execute(self, pipe: redis.client.Pipeline, num_bytes: int | None) -> list[object]:
        """Run a pipeline; one that moved `num_bytes` of values is timed into the link estimate
        (None: many small commands, whose cost is per command rather than per byte)."""
        t0 = time.monotonic()
        results: list[object] = pipe.execute(raise_on_error=False)
        if num_bytes is not None:
            self.link.observe(num_bytes, time.monotonic() - t0)
        return results

    def _set_resending(self, values: list[tuple[str, bytes]], num_bytes: int) -> list[object]:
        """SET every (key, value) in one pipeline, sent again with backoff while the server stalls
        (socket timeout), for up to RESEND_WINDOW_S; then every command counts as failed.
        (A pipeline forgets its commands when it runs, so each attempt builds a new one.)"""
        n = len(values)
        deadline = time.monotonic() + RESEND_WINDOW_S
        wait = 0.1
        while True:
            pipe = self.client.pipeline(transaction=False)
            for key, value in values:
                pipe.set(key, value, ex=self.ttl_s)
            try:
                return self._execute(pipe, num_bytes)
            except redis.TimeoutError as e:  # stalled (paused, busy); refused or reset: down
                if self._closing or time.monotonic() + wait > deadline:
                    return [e] * n
                log.info("KV Redis write stalled (%s); sending again in %.1f s", e, wait)
                time.sleep(wait)
                wait = min(2 * wait, 1.0)
            except redis.RedisError as e:
                return [e] * n

    def _write(self, saves: list[_Save]) -> list[bool]:
        """SET every page, in pipelines of at most BATCH_BYTES; which pages were stored."""
        pending: list[tuple[bytes, bytes]] = []
        for item in saves:
            pending += zip(item.hashes, self.codec.payloads(item.pages), strict=True)
        stored: list[bool] = []
        start = 0
        while start < len(pending):
            if not self.writable():
                self.counters.dropped += len(pending) - start
                return stored + [False] * (len(pending) - start)
            values: list[tuple[str, bytes]] = []
            num_bytes = 0
            end = start
            while end < len(pending) and (end == start or num_bytes + self.value_bytes <= BATCH_BYTES):
                h, payload = pending[end]
                value = self.codec.encode(h, payload)
                values.append((self.key(h), value))
                num_bytes += len(value)
                end += 1
            results = self._set_resending(values, num_bytes)
            stored += [not isinstance(r, Exception) for r in results]
            errors = [r for r in results if isinstance(r, Exception)]
            self.counters.written += len(results) - len(errors)
            if errors:  # e.g. OOM under noeviction: writes stop for a while, reads go on
                self.counters.write_failures += 1
                self.counters.dropped += len(errors)
                self._failed(errors[0])
            start = end
        return stored

    def _refresh(self, hashes: list[bytes]) -> None:
        """Pipelined EXPIRE; a page whose key is gone is written again if `rewrite` has it."""
        if not hashes or not self.writable():
            return
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.expire(self.key(h), self.ttl_s)
        try:
            results = self._execute(pipe, None)
        except redis.RedisError as e:
            results = [e]
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            self.counters.write_failures += 1
            self._failed(errors[0])
            with self._lock:  # not refreshed: try again on the next use
                for h in hashes:
                    self._refreshed.pop(h, None)
            return
        gone = [h for h, ok in zip(hashes, results, strict=True) if not ok]
        self.ledger.mark_stored([h for h, ok in zip(hashes, results, strict=True) if ok])
        self.ledger.forget(gone)
        self.counters.refreshed += len(hashes) - len(gone)
        self.counters.absent += len(gone)
        copy = self.rewrite(gone) if gone and self.rewrite is not None else None
        if copy is not None:
            written = self.counters.written
            ok = self._write([_Save(copy[0], copy[1], 0)])
            self.ledger.mark_stored([h for h, o in zip(copy[0], ok, strict=True) if o])
            self.counters.rewritten += self.counters.written - written
        again = set(copy[0]) if copy is not None else set()
        with self._lock:  # those not written again: look again on the next use
            for h in gone:
                if h not in again:
                    self._refreshed.pop(h, None)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and refresh is done or dropped (tests, shutdown)."""
        return self._idle.wait(timeout_s)

    def commit_wait(self, timeout_s: float, pending_ttl_s: float = 30.0) -> bool:
        """A turn is about to commit: wait up to `timeout_s` until every page queued so far is
        written (or dropped), so that the next turn, on any server, finds them. At the bound the
        pages still queued are marked pending in Redis (`<page key>:pending`, `pending_ttl_s`):
        a lookup that meets such a mark waits for the page (`RedisTier.get_prefix`) rather than
        recomputing it. True if nothing was left queued."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            target = self._queued_seq
            if self._done_below > target:
                return True
            self.counters.commit_waits += 1
            while self._done_below <= target:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(left)
            if self._done_below > target:
                return True
            self.counters.commit_wait_timeouts += 1
            left_over = [h for seq, hashes in self._queued.items() if seq <= target for h in hashes]
        self._mark_pending(left_over, pending_ttl_s)
        return False

    def _mark_pending(self, hashes: list[bytes], ttl_s: float) -> None:
        if not hashes or not self.writable():
            return
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.set(self.key(h) + ":pending", b"1", px=int(ttl_s * 1000), nx=True)
        try:
            pipe.execute(raise_on_error=False)
            self.counters.pending_marked += len(hashes)
        except redis.RedisError as e:
            log.info("KV pending marks not written: %s", e)

    def close(self) -> None:
        self._closing = True
        self._queue.put(None)
        self._thread.join(timeout=5)
        self.client.close()
