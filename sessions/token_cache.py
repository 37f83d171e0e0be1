"""Token ids of recent turns, found again from the history a client re-sends (`store: false`).

A client that stores nothing server-side (`store: false`, the Codex CLI) re-sends the whole
history each turn. Rendered and tokenized anew, that history need not give the ids the model
saw: a reply's text can tokenize differently from how it was generated, and the prefix cache,
which matches ids, would miss from the first such boundary on. So after each turn that ended
normally the ids it ran on, prompt + output P + O, are kept for `TTL_S` under a hash of the text
they stand for (`decode(P + O)`), and the next request without a stored chain looks its
rendered prompt up: every place where the prompt continues with an end-of-turn marker (the text
before it is where a turn's output ended) is hashed, all candidates are fetched in one MGET
(split per slot on a Redis Cluster), and the longest hit whose ids decode to exactly that
text becomes the `previous` ids the new prompt continues (`sessions.render.build_prompt`).

It is a cache, not stored state, so it keeps `store: false`'s meaning: entries expire by
themselves, are per tenant, hold ids only (no items, no response), and losing one costs a
re-prefill, never an answer. Keys: `P:tok:{tenant}:{blake2b(text)}`, values the ids as uint32.
"""

from __future__ import annotations

import array
import hashlib
import logging
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvstore.redis_connect import mget_async

log = logging.getLogger("longctx.sessions")

TTL_S = 3600
MAX_CANDIDATES = 64  # the last boundaries of a prompt tried (a reply continues one of the latest turns)


def text_key(prefix: str, tenant: str, text: str) -> str:
    return f"{prefix}:tok:{tenant}:{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}"


def boundaries(text: str, markers: Sequence[str]) -> list[int]:
    """Where a turn's output can have ended in `text`: before each end-of-turn marker, latest first."""
    found: set[int] = set()
    for marker in markers:
        if not marker:
            continue
        at = text.find(marker)
        while at > 0:
            found.add(at)
            at = text.find(marker, at + 1)
    return sorted(found, reverse=True)[:MAX_CANDIDATES]


class TokenCache:
    """See the module docstring. Redis failures are logged and treated as misses."""

    def __init__(self, client: Redis, prefix: str, ttl_s: int = TTL_S):
        self.client, self.prefix, self.ttl_s = client, prefix, ttl_s

    async def remember(self, tenant: str, text: str, ids: Sequence[int]) -> None:
        """Keep `ids` (a turn's prompt + output) under the text they decode to."""
        try:
            await self.client.set(text_key(self.prefix, tenant, text), array.array("I", ids).tobytes(), ex=self.ttl_s)
        except RedisError as e:
            log.warning("token cache write failed: %s", e)

    async def find(self, tenant: str, text: str, markers: Sequence[str]) -> list[tuple[int, list[int]]]:
        """Candidates for `text`'s previous ids: (length of the text they stand for, ids), longest
        first. The caller checks that the ids decode to exactly `text[:length]`."""
        cuts = boundaries(text, markers)
        if not cuts:
            return []
        try:
            values = await mget_async(self.client, [text_key(self.prefix, tenant, text[:c]) for c in cuts])
        except RedisError as e:
            log.warning("token cache read failed: %s", e)
            return []
        out = []
        for cut, raw in zip(cuts, values, strict=True):
            if raw:
                ids = array.array("I")
                ids.frombytes(raw if isinstance(raw, bytes) else raw.encode())
                out.append((cut, ids.tolist()))
        return out
