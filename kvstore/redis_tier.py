"""The Redis KV tier: one value per page under `{prefix}:{namespace}:{page hash}`.

On a Redis Cluster (`kvstore.redis_connect`) pages spread over the masters by their key, that
is by their content hash; a batched read is split per slot and pipelined per node, and a node
that fails costs the pages of that read (recomputed), never a request.

Writes go behind (`kvstore.redis_writer.RedisWriter`: a thread, a queue bounded in bytes,
TTLs refreshed on use, lost pages written again). Reads (`get_prefix`, one `MGET` of at most
`BATCH_BYTES` per batch) run on the caller's thread, which the store keeps off the step
thread. Every value is verified (`PageCodec.decode`) before use; a bad one is counted and
treated as a miss, so the page is recomputed and the write-behind overwrites the bad value.

Redis is a cache here, and its health is tracked per direction: a failed read stops lookups
for `retry_s`, a failed write stops writes (the writer's own clock), each with one warning
and a counter. A full server (out of memory under `noeviction`) thus still serves lookups.
Nothing waits on Redis but the writer and lookup threads. Both time their requests into one
`TransferEstimate`, so the engine can tell whether waiting for a lookup beats recomputing
(`fetch_cost_s`); the reader connects and times a PING when the tier is built.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
import torch

from kvstore.codec import BadPage, PageCodec, Payload
from kvstore.redis_connect import cluster_enabled, connect, mget
from kvstore.redis_writer import BATCH_BYTES, RedisCounters, RedisWriter
from kvstore.transfer_estimate import TransferEstimate

__all__ = ["BATCH_BYTES", "RedisCounters", "RedisTier"]

log = logging.getLogger("longctx.kv.redis")

KEYS_PER_PIPELINE = 512  # EXISTS per pipeline when counting (keys only: no values move)
PENDING_WAIT_S = 5.0  # longest wait for one pending page (the caller's deadline usually ends it first)
PENDING_POLL_S = 0.005


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
        self.prefix = f"{prefix}:{codec.namespace}:"
        self.retry_s = retry_s
        self.counters = RedisCounters()
        self.link = TransferEstimate()
        try:
            self.cluster = cluster_enabled(url, timeout_s=1.0)
        except redis.RedisError:
            self.cluster = False  # unreachable now: a single server until it answers (a restart asks again)
        self._reader = connect(
            url, cluster=self.cluster, socket_timeout=min(timeout_s, 1.0), socket_connect_timeout=1.0
        )
        self._read_down_until = 0.0
        self._connect_reader()
        client = connect(url, cluster=self.cluster, socket_timeout=timeout_s, socket_connect_timeout=1.0)
        self.writer = RedisWriter(client, codec, self.key, ttl_s, max_pending_bytes, self.counters, self.link, retry_s)  # type: ignore[arg-type]
        self.value_bytes = self.writer.value_bytes
        self.pages_per_read = max(1, BATCH_BYTES // self.value_bytes)

    def key(self, page_hash: bytes) -> str:
        return self.prefix + page_hash.hex()

    def readable(self) -> bool:
        return time.monotonic() >= self._read_down_until

    def writable(self) -> bool:
        return self.writer.writable()

    def save(self, page_hashes: list[bytes], pages: torch.Tensor) -> bool:
        """Queue pages [N, L, 2, P, H, D] (a copy, model dtype) for writing; never blocks.
        False if they were dropped (queue full, writes down)."""
        return self.writer.save(page_hashes, pages)

    def touch(self, page_hashes: list[bytes]) -> None:
        """These pages were used again: refresh their TTL (at most once per `refresh_s`)."""
        self.writer.touch(page_hashes)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and refresh is done or dropped (tests, shutdown)."""
        return self.writer.flush(timeout_s)

    def commit_wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the pages queued so far; the rest are marked pending
        (`RedisWriter.commit_wait`)."""
        return self.writer.commit_wait(timeout_s)

    def fetch_cost_s(self, num_pages: int) -> float:
        """Expected seconds to read `num_pages` pages, from the measured round trip and rate."""
        batches = -(-num_pages // self.pages_per_read)
        return self.link.seconds(num_pages * self.value_bytes, batches)

    # ---- writes (write-behind thread) ----

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

    # ---- reads (lookup thread) ----

    def get_prefix(
        self,
        page_hashes: list[bytes],
        out: list[Payload],
        cancel: threading.Event,
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        """Append to `out` the verified payloads of the leading pages found (in the writer's
        queue, not yet written, or in Redis), batch by batch, so that a caller out of time can
        use what has arrived; stops at the first missing or bad page, or when `cancel` is set.
        A missing page marked pending (its turn committed before its writer was done:
        `RedisWriter.commit_wait`) is waited for until it lands, the mark goes, `cancel` is set
        (the caller's deadline) or `PENDING_WAIT_S` passes. `on_batch` is called after each
        batch's pages are appended (the caller copies them on while the next batch is read)."""
        ledger = self.writer.ledger
        try:
            start = 0
            waited_until = 0.0
            while start < len(page_hashes):
                if cancel.is_set():
                    return
                hashes = page_hashes[start : start + self.pages_per_read]
                # The writer's queue first, Redis second: a page leaves the queue only once stored.
                queued = [ledger.queued(h) for h in hashes]
                keys = [self.key(h) for h, q in zip(hashes, queued, strict=True) if q is None]
                values: list[bytes | None] = []
                if keys:
                    t0 = time.monotonic()
                    values = mget(self._reader, keys)
                    self.link.observe(sum(len(v) for v in values if v is not None), time.monotonic() - t0)
                remote = iter(values)
                for h, page in zip(hashes, queued, strict=True):
                    if page is not None:
                        out.append(self.codec.payloads(page[None])[0])
                        self.counters.queue_hits += 1
                        waited_until = 0.0
                        start += 1
                        continue
                    value = next(remote)
                    if value is None:
                        if waited_until == 0.0 and self._reader.exists(self.key(h) + ":pending"):
                            self.counters.pending_waited += 1
                            waited_until = time.monotonic() + PENDING_WAIT_S
                        if waited_until and time.monotonic() < waited_until:
                            if not self._reader.exists(self.key(h) + ":pending") and not self._reader.exists(
                                self.key(h)
                            ):
                                self.counters.missing += 1
                                return
                            time.sleep(PENDING_POLL_S)
                            break  # read again from this page
                        self.counters.missing += 1
                        return
                    waited_until = 0.0
                    try:
                        payload = self.codec.decode(value, h)
                    except BadPage as e:
                        self.counters.bad_pages += 1
                        log.warning("dropped KV page %s from Redis: %s", h.hex(), e)
                        return
                    out.append(payload)
                    ledger.mark_stored([h])
                    self.counters.found += 1
                    start += 1
                if on_batch is not None:
                    on_batch()
        except redis.RedisError as e:
            self.counters.read_failures += 1
            was_up = self.readable()
            self._read_down_until = time.monotonic() + self.retry_s
            if was_up:
                log.warning("KV Redis lookups off for %.0f s (%s); recomputing instead", self.retry_s, e)

    def exists(self, page_hashes: list[bytes]) -> list[bool]:
        """Which of these pages exist (in the writer's queue, else a pipelined EXISTS; values not
        read); on an error, the rest count as missing (the tier's health is left to the real
        lookups)."""
        queued = [self.writer.ledger.queued(h) is not None for h in page_hashes]
        asked = [h for h, q in zip(page_hashes, queued, strict=True) if not q]
        found: list[bool] = []
        try:
            for start in range(0, len(asked), KEYS_PER_PIPELINE):
                pipe = self._reader.pipeline(transaction=False)
                for h in asked[start : start + KEYS_PER_PIPELINE]:
                    pipe.exists(self.key(h))
                found += [bool(n) for n in pipe.execute()]
        except redis.RedisError:
            pass
        answers = iter(found + [False] * (len(asked) - len(found)))
        return [q or next(answers) for q in queued]

    def close(self) -> None:
        self.writer.close()
        self._reader.close()
