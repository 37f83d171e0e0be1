"""The Redis KV tier: one value per page under `{prefix}:{namespace}:{page hash}`.

Writes go behind: `save` only queues a snapshot of the pages; a writer thread encodes them
(header + checksum, int8 if asked) and sends them in pipelines of `SET ... EX ttl`, usually
within milliseconds of the page filling. Reads (`get_prefix`, one `MGET` per batch) run on
the caller's thread, which the store keeps off the step thread. Every value is verified
(`PageCodec.decode`) before use; a bad one is counted and treated as a miss, so the page is
recomputed and the write-behind overwrites the bad value. The write queue and every pipeline
or `MGET` are bounded in bytes, not pages: a 70B model's page is 20x the demo's.

Lifetime: a page's TTL is refreshed (pipelined `EXPIRE`, on the writer thread) whenever the
engine uses it again, at most once per `refresh_s`, so a conversation in use never expires.
An `EXPIRE` that finds no key (expired, evicted, lost in an outage) asks `rewrite` for a copy
of the page (the store still holds it in device memory) and writes it again at once.

Redis is a cache here, and its health is tracked per direction: a failed write (unreachable,
timeout, out of memory under `noeviction`) stops writes for `retry_s`, a failed read stops
lookups for `retry_s`, each with one warning and a counter. A full server thus still serves
lookups. Nothing waits on Redis but the writer and lookup threads. Both time their requests,
so the engine can tell whether waiting for a lookup beats recomputing (`fetch_cost_s`);
the reader connects and times a PING when the tier is built.
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

from kvstore.codec import BadPage, PageCodec
from kvstore.transfer_estimate import TransferEstimate

log = logging.getLogger("longctx.kv.redis")

BATCH_BYTES = 8 << 20  # most bytes per pipeline or MGET
MAX_REFRESH_S = 60.0  # a used page's TTL is refreshed at most this often (and at most every TTL / 3)
TRACKED_PAGES = 1 << 18  # pages whose last refresh is remembered, LRU


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


class _Save(NamedTuple):
    hashes: list[bytes]
    pages: torch.Tensor  # [N, L, 2, P, H, D] model dtype, a copy
    num_bytes: int


class _Touch(NamedTuple):
    hashes: list[bytes]


class RedisTier:
    """Args:
    url: redis:// or unix:// URL of the KV Redis.
    codec: page encoding for this model and storage dtype.
    ttl_s: expiry of every page key, refreshed on use.
    prefix: key prefix (tests use a unique one per run).
    max_pending_bytes: most bytes of page copies waiting to be written; more are dropped,
        never waited for.
    timeout_s: socket timeout of the writer (the reader uses min(timeout_s, 1 s)).
    retry_s: how long a failure keeps its direction (reads or writes) down.
    """

    def __init__(
        self,
        url: str,
        codec: PageCodec,
        ttl_s: int = 86_400,
        prefix: str = "kv",
        max_pending_bytes: int = 256 << 20,
        timeout_s: float = 5.0,
        retry_s: float = 5.0,
    ):
        self.codec = codec
        self.ttl_s = ttl_s
        self.refresh_s = min(MAX_REFRESH_S, ttl_s / 3)
        self.prefix = f"{prefix}:{codec.namespace}:"
        self.max_pending_bytes = max_pending_bytes
        self.retry_s = retry_s
        self.counters = RedisCounters()
        self.link = TransferEstimate()
        # A stored value: the payload and a header of about a hundred bytes.
        self.value_bytes = codec.payload_len + 128
        self.pages_per_read = max(1, BATCH_BYTES // self.value_bytes)
        self._reader = redis.Redis.from_url(url, socket_timeout=min(timeout_s, 1.0), socket_connect_timeout=1.0)
        self._writer = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=1.0)
        self._queue: queue.Queue[_Save | _Touch | None] = queue.Queue()
        self._pending_bytes = 0
        self._pending_items = 0
        self._lock = threading.Lock()
        self._read_down_until = 0.0
        self._write_down_until = 0.0
        self._refreshed: OrderedDict[bytes, float] = OrderedDict()  # page -> last write or refresh
        # Called on the writer thread with pages found gone on refresh: a copy of those still
        # at hand, (hashes, pages [N, L, 2, P, H, D]), to write again, or None.
        self.rewrite: Callable[[list[bytes]], tuple[list[bytes], torch.Tensor] | None] | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._connect_reader()
        self._thread = threading.Thread(target=self._write_loop, name="longctx-kv-writer", daemon=True)
        self._thread.start()

    def key(self, page_hash: bytes) -> str:
        return self.prefix + page_hash.hex()

    def readable(self) -> bool:
        return time.monotonic() >= self._read_down_until

    def writable(self) -> bool:
        return time.monotonic() >= self._write_down_until

    def _failed(self, what: str, e: Exception) -> None:
        until = time.monotonic() + self.retry_s
        if what == "read":
            was_up, self._read_down_until = self.readable(), until
        else:
            was_up, self._write_down_until = self.writable(), until
        if was_up:
            log.warning("KV Redis %ss off for %.0f s (%s); serving without them", what, self.retry_s, e)

    def fetch_cost_s(self, num_pages: int) -> float:
        """Expected seconds to read `num_pages` pages, from the measured round trip and rate."""
        batches = -(-num_pages // self.pages_per_read)
        return self.link.seconds(num_pages * self.value_bytes, batches)

    # ---- writes (write-behind thread) ----

    def save(self, page_hashes: list[bytes], pages: torch.Tensor) -> None:
        """Queue pages [N, L, 2, P, H, D] (a copy, model dtype) for writing; never blocks."""
        num_bytes = pages.numel() * pages.element_size()
        with self._lock:
            if not self.writable() or self._pending_bytes + num_bytes > self.max_pending_bytes:
                self.counters.dropped += len(page_hashes)
                return
            self._pending_bytes += num_bytes
            self._pending_items += 1
            self._idle.clear()
            now = time.monotonic()
            for h in page_hashes:  # a SET starts a fresh TTL
                self._remember(h, now)
        self._queue.put(_Save(page_hashes, pages, num_bytes))

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
            self._writer.ping()  # connect before the first write
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
            try:
                self._write(saves)
                self._refresh(touches)
            except Exception as e:  # never let the writer thread die
                log.exception("KV writer: %s", e)
            with self._lock:
                self._pending_bytes -= size
                self._pending_items -= len(batch)
                if self._pending_items == 0:
                    self._idle.set()

    def _connect_reader(self) -> None:
        """Connect the reader now and time one PING: a connection's handshake takes several
        round trips, which the first lookup should not pay, and the first lookup's deadline
        should already know a slow Redis. At most the reader's timeouts (about 2 s)."""
        try:
            self._reader.ping()
            t0 = time.monotonic()
            self._reader.ping()
            self.link.observe(0, time.monotonic() - t0)
        except redis.RedisError:
            pass  # an unreachable Redis shows itself on the first read or write

    def _execute(self, pipe: redis.client.Pipeline, num_bytes: int) -> list[object]:
        t0 = time.monotonic()
        results: list[object] = pipe.execute(raise_on_error=False)
        self.link.observe(num_bytes, time.monotonic() - t0)
        return results

    def _write(self, saves: list[_Save]) -> None:
        """SET every page, in pipelines of at most BATCH_BYTES."""
        pending: list[tuple[bytes, bytes]] = []
        for item in saves:
            pending += zip(item.hashes, self.codec.payloads(item.pages), strict=True)
        start = 0
        while start < len(pending):
            if not self.writable():
                self.counters.dropped += len(pending) - start
                return
            pipe = self._writer.pipeline(transaction=False)
            num_bytes = 0
            end = start
            while end < len(pending) and (end == start or num_bytes + self.value_bytes <= BATCH_BYTES):
                h, payload = pending[end]
                value = self.codec.encode(h, payload)
                pipe.set(self.key(h), value, ex=self.ttl_s)
                num_bytes += len(value)
                end += 1
            try:
                results = self._execute(pipe, num_bytes)
            except redis.RedisError as e:
                results = [e] * (end - start)
            errors = [r for r in results if isinstance(r, Exception)]
            self.counters.written += len(results) - len(errors)
            if errors:  # e.g. OOM under noeviction: writes stop for a while, reads go on
                self.counters.write_failures += 1
                self.counters.dropped += len(errors)
                self._failed("write", errors[0])
            start = end

    def _refresh(self, hashes: list[bytes]) -> None:
        """Pipelined EXPIRE; a page whose key is gone is written again if `rewrite` has it."""
        if not hashes or not self.writable():
            return
        pipe = self._writer.pipeline(transaction=False)
        for h in hashes:
            pipe.expire(self.key(h), self.ttl_s)
        try:
            results = self._execute(pipe, 64 * len(hashes))
        except redis.RedisError as e:
            results = [e]
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            self.counters.write_failures += 1
            self._failed("write", errors[0])
            with self._lock:  # not refreshed: try again on the next use
                for h in hashes:
                    self._refreshed.pop(h, None)
            return
        gone = [h for h, ok in zip(hashes, results, strict=True) if not ok]
        self.counters.refreshed += len(hashes) - len(gone)
        self.counters.absent += len(gone)
        copy = self.rewrite(gone) if gone and self.rewrite is not None else None
        if copy is not None:
            written = self.counters.written
            self._write([_Save(copy[0], copy[1], 0)])
            self.counters.rewritten += self.counters.written - written
        else:
            with self._lock:  # not written again: look again on the next use
                for h in gone:
                    self._refreshed.pop(h, None)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and refresh is done or dropped (tests, shutdown)."""
        return self._idle.wait(timeout_s)

    # ---- reads (lookup thread) ----

    def get_prefix(self, page_hashes: list[bytes], out: list[bytes], cancel: threading.Event) -> None:
        """Append to `out` the verified payloads of the leading pages found, batch by batch, so
        that a caller out of time can use what has arrived; stops at the first missing or bad
        page, or when `cancel` is set."""
        try:
            for start in range(0, len(page_hashes), self.pages_per_read):
                if cancel.is_set():
                    return
                hashes = page_hashes[start : start + self.pages_per_read]
                t0 = time.monotonic()
                values: list[bytes | None] = self._reader.mget([self.key(h) for h in hashes])  # type: ignore[assignment]
                self.link.observe(sum(len(v) for v in values if v is not None), time.monotonic() - t0)
                for h, value in zip(hashes, values, strict=True):
                    if value is None:
                        self.counters.missing += 1
                        return
                    try:
                        payload = self.codec.decode(value, h)
                    except BadPage as e:
                        self.counters.bad_pages += 1
                        log.warning("dropped KV page %s from Redis: %s", h.hex(), e)
                        return
                    out.append(payload)
                    self.counters.found += 1
        except redis.RedisError as e:
            self.counters.read_failures += 1
            self._failed("read", e)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._reader.close()
        self._writer.close()
