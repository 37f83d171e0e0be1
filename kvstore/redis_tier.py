"""The Redis KV tier: one value per page under `{prefix}:{namespace}:{page hash}`.

Writes go behind: `save` only queues a snapshot of the pages; a writer thread encodes them
(header + checksum, int8 if asked) and sends them in pipelines of `SET ... EX ttl`, usually
within milliseconds of the page filling. Reads (`get_prefix`, one `MGET` per batch) run on
the caller's thread, which the store keeps off the step thread. Every value is verified
(`PageCodec.decode`) before use; a bad one is counted and treated as a miss, so the page is
recomputed and the write-behind overwrites the bad value.

Redis is a cache here: an error (unreachable, timeout, out of memory under `noeviction`)
marks the tier down for `retry_s` with one warning and a counter; while down, saves are
dropped and lookups miss. Nothing waits on Redis but the writer and lookup threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import redis
import torch

from kvstore.codec import BadPage, PageCodec

log = logging.getLogger("longctx.kv.redis")

BATCH = 64  # pages per pipeline or MGET


@dataclass(slots=True)
class RedisCounters:
    written: int = 0  # pages stored
    write_failures: int = 0  # failed pipelines (each drops its batch)
    dropped: int = 0  # pages not written: queue full or tier down
    found: int = 0  # pages read back and verified
    loaded: int = 0  # of those, pages copied into device memory
    missing: int = 0  # lookups that stopped at an absent key
    bad_pages: int = 0  # values rejected by the codec (damaged, truncated, foreign)
    read_failures: int = 0  # failed MGETs


class RedisTier:
    """Args:
    url: redis:// or unix:// URL of the KV Redis.
    codec: page encoding for this model and storage dtype.
    ttl_s: expiry of every page key.
    prefix: key prefix (tests use a unique one per run).
    queue_pages: most pages waiting to be written; more are dropped, never waited for.
    timeout_s: socket timeout of the writer (the reader uses min(timeout_s, 1 s)).
    retry_s: how long a failure keeps the tier down.
    """

    def __init__(
        self,
        url: str,
        codec: PageCodec,
        ttl_s: int = 86_400,
        prefix: str = "kv",
        queue_pages: int = 4096,
        timeout_s: float = 5.0,
        retry_s: float = 5.0,
    ):
        self.codec = codec
        self.ttl_s = ttl_s
        self.prefix = f"{prefix}:{codec.namespace}:"
        self.retry_s = retry_s
        self.counters = RedisCounters()
        self._reader = redis.Redis.from_url(url, socket_timeout=min(timeout_s, 1.0), socket_connect_timeout=1.0)
        self._writer = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=1.0)
        self._queue: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue()
        self._queued = 0  # pages in the queue
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._write_loop, name="longctx-kv-writer", daemon=True)
        self.queue_pages = queue_pages
        self._thread.start()

    def key(self, page_hash: bytes) -> str:
        return self.prefix + page_hash.hex()

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        was_up = self.available()
        self._down_until = time.monotonic() + self.retry_s
        if was_up:
            log.warning("KV Redis tier down for %.0f s (%s failed: %s); serving without it", self.retry_s, what, e)

    # ---- writes (write-behind thread) ----

    def save(self, page_hashes: list[bytes], pages: torch.Tensor) -> None:
        """Queue pages [N, L, 2, P, H, D] (a copy, model dtype) for writing; never blocks."""
        with self._lock:
            if not self.available() or self._queued + len(page_hashes) > self.queue_pages:
                self.counters.dropped += len(page_hashes)
                return
            self._queued += len(page_hashes)
            self._idle.clear()
        self._queue.put((page_hashes, pages))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            n = len(item[0])
            while n < BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
                n += len(nxt[0])
            try:
                self._write(batch)
            except Exception as e:
                self.counters.write_failures += 1
                self.counters.dropped += n
                self._failed("write", e)
            with self._lock:
                self._queued -= n
                if self._queued == 0:
                    self._idle.set()

    def _write(self, batch: list[tuple[list[bytes], torch.Tensor]]) -> None:
        if not self.available():
            self.counters.dropped += sum(len(h) for h, _ in batch)
            return
        pipe = self._writer.pipeline(transaction=False)
        n = 0
        for hashes, pages in batch:
            for h, payload in zip(hashes, self.codec.payloads(pages), strict=True):
                pipe.set(self.key(h), self.codec.encode(h, payload), ex=self.ttl_s)
                n += 1
        pipe.execute()
        self.counters.written += n

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued page has been written or dropped (tests, shutdown)."""
        return self._idle.wait(timeout_s)

    # ---- reads (lookup thread) ----

    def get_prefix(self, page_hashes: list[bytes], out: list[bytes], cancel: threading.Event) -> None:
        """Append to `out` the verified payloads of the leading pages found, batch by batch, so
        that a caller out of time can use what has arrived; stops at the first missing or bad
        page, or when `cancel` is set."""
        try:
            for start in range(0, len(page_hashes), BATCH):
                if cancel.is_set():
                    return
                hashes = page_hashes[start : start + BATCH]
                values: list[bytes | None] = self._reader.mget([self.key(h) for h in hashes])  # type: ignore[assignment]
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

    def count_prefix(self, page_hashes: list[bytes]) -> int:
        """How many leading pages exist in Redis (pipelined EXISTS; values are not read or
        verified); an error ends the count (the tier's health is left to the real lookups)."""
        n = 0
        try:
            for start in range(0, len(page_hashes), BATCH):
                pipe = self._reader.pipeline(transaction=False)
                for h in page_hashes[start : start + BATCH]:
                    pipe.exists(self.key(h))
                for found in pipe.execute():
                    if not found:
                        return n
                    n += 1
        except redis.RedisError:
            return n
        return n

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._reader.close()
        self._writer.close()
