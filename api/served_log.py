"""What this replica served lately, as `longctx route` keys it: the affinity keys and prompt-prefix
fingerprints of its generation requests (`api.router.affinity`), newest last, as many as its
device KV pool would hold (a request's tokens estimated at `BYTES_PER_TOKEN` of its body), so
the list approximates whose pages the device still holds (it evicts least recently used)."""

from __future__ import annotations

from collections import OrderedDict

from api.router.affinity import CHUNK_CHARS

MAX_PUBLISHED = 1024  # keys, and fingerprints, in one entry at most
BYTES_PER_TOKEN = 4


class ServedLog:
    """The keys and fingerprints this replica served, newest last, bounded by its device pool."""

    def __init__(self) -> None:
        self.capacity_tokens = 0  # 0: unknown (bounded by count only)
        self.keys: OrderedDict[str, int] = OrderedDict()  # key -> estimated prompt tokens
        self.prefixes: OrderedDict[str, None] = OrderedDict()
        self.in_flight = 0
        self._tokens = 0

    def record(self, key: str | None, fingerprints: list[str], tokens: int) -> None:
        if key is not None:
            self._tokens += tokens - self.keys.pop(key, 0)
            self.keys[key] = tokens
            while len(self.keys) > 1 and (
                len(self.keys) > MAX_PUBLISHED or (self.capacity_tokens and self._tokens > self.capacity_tokens)
            ):
                self._tokens -= self.keys.popitem(last=False)[1]
        for fp in fingerprints:
            self.prefixes.pop(fp, None)
            self.prefixes[fp] = None
        chunk_tokens = CHUNK_CHARS // BYTES_PER_TOKEN
        most = min(MAX_PUBLISHED, self.capacity_tokens // chunk_tokens) if self.capacity_tokens else MAX_PUBLISHED
        while len(self.prefixes) > max(1, most):
            self.prefixes.popitem(last=False)
