"""Affinity keys: where a request's KV cache most likely is.

A conversation's responses share its slot tag, and a `previous_response_id` chain shares its
first response's (`sessions.ids`), so one key stands for a whole conversation or chain: `conv:`
+ the tag. A `prompt_cache_key` is its own key. Keys are scoped per tenant by a hash of the
`Authorization` header (the router never keeps or logs the header itself). The table maps keys
to the replica that served them last, LRU-bounded.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from typing import Any

from sessions.ids import slot_tag

MAX_KEYS = 100_000
_PATH_ID = re.compile(r"^/v1/(?:conversations|responses)/((?:conv|resp)_[0-9A-Za-z]+)")
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-f]+)"')


def tenant_of(authorization: str | None) -> str:
    """A short hash of the Authorization header: the scope of its affinity keys."""
    return hashlib.blake2b((authorization or "").encode(), digest_size=8).hexdigest()


def id_key(tenant: str, any_id: str) -> str:
    return f"{tenant}:tag:{slot_tag(any_id)}"


def request_key(tenant: str, path: str, body: bytes) -> str | None:
    """The request's affinity key, or None (no conversation, chain or cache key)."""
    m = _PATH_ID.match(path)
    if m:
        return id_key(tenant, m.group(1))
    if not body or not path.startswith("/v1/"):
        return None
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    conv = data.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    if isinstance(conv, str) and conv:
        return id_key(tenant, conv)
    prev = data.get("previous_response_id")
    if isinstance(prev, str) and prev:
        return id_key(tenant, prev)
    pck = data.get("prompt_cache_key")
    if isinstance(pck, str) and pck:
        return f"{tenant}:pck:{hashlib.blake2b(pck.encode(), digest_size=12).hexdigest()}"
    return None


class AffinityTable:
    """key -> replica URL that served it last (LRU, at most `max_keys`)."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        url = self._map.get(key)
        if url is not None:
            self._map.move_to_end(key)
        return url

    def put(self, key: str, url: str) -> None:
        self._map[key] = url
        self._map.move_to_end(key)
        while len(self._map) > self.max_keys:
            self._map.popitem(last=False)
