"""Affinity keys: where a request's KV cache most likely is.

A conversation's responses share its slot tag, and a `previous_response_id` chain shares its
first response's (`sessions.ids`), so one key stands for a whole conversation or chain: `conv:`
+ the tag. A `prompt_cache_key` is its own key. Keys are scoped per tenant by a hash of the
`Authorization` header (the router never keeps or logs the header itself). The table maps keys
to the replica that served them last, LRU-bounded.

A request without a key (a Chat Completions call, a stateless Responses call) has prefix
fingerprints instead: a hash chain over its prompt's leading text (tools, instructions and
messages, in order) cut in `CHUNK_CHARS` pieces, at most `MAX_CHUNKS`, scoped per tenant. Two
requests whose prompts begin alike share their leading fingerprints, as their prompts share
their leading KV pages; the replica holding the longest matching run most likely holds those
pages.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from typing import Any

from sessions.ids import slot_tag

MAX_KEYS = 100_000
CHUNK_CHARS = 1024  # about 250 tokens: some 16 pages of 16 tokens
MAX_CHUNKS = 16  # fingerprints cover the prompt's first 16 KiB of text
_PATH_ID = re.compile(r"^/v1/(?:conversations|responses)/((?:conv|resp)_[0-9A-Za-z]+)")
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-f]+)"')


def tenant_of(authorization: str | None) -> str:
    """A short hash of the Authorization header: the scope of its affinity keys."""
    return hashlib.blake2b((authorization or "").encode(), digest_size=8).hexdigest()


def id_key(tenant: str, any_id: str) -> str:
    return f"{tenant}:tag:{slot_tag(any_id)}"


def parse_body(path: str, body: bytes) -> dict[str, Any] | None:
    """A `/v1/` request's JSON body as a dict, or None (no body, not JSON, not an object)."""
    if not body or not path.startswith("/v1/"):
        return None
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def request_key(tenant: str, path: str, data: dict[str, Any] | None) -> str | None:
    """The request's affinity key, or None (no conversation, chain or cache key)."""
    m = _PATH_ID.match(path)
    if m:
        return id_key(tenant, m.group(1))
    if data is None:
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


def _text(value: Any) -> str:
    """The text of a message's content or an input item, in order (parts' texts joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        if "content" in value:
            return f"<{value.get('role', '')}>" + _text(value["content"])
        for name in ("text", "arguments", "output"):
            if isinstance(value.get(name), str):
                return str(value[name])
    return ""


def prompt_text(data: dict[str, Any]) -> str:
    """The leading text of the prompt a Chat Completions or Responses body renders to."""
    parts = []
    if data.get("tools"):
        parts.append(json.dumps(data["tools"], sort_keys=True))
    if isinstance(data.get("instructions"), str):
        parts.append(data["instructions"])
    for name in ("messages", "input"):
        if name in data:
            parts.append(_text(data[name]))
    return "\x1e".join(parts)


def prefix_fingerprints(tenant: str, data: dict[str, Any] | None) -> list[str]:
    """Hash chain over the prompt text's full `CHUNK_CHARS` pieces (at most `MAX_CHUNKS`):
    the i-th fingerprint stands for the first i+1 pieces, scoped by `tenant`."""
    if data is None:
        return []
    text = prompt_text(data)
    out: list[str] = []
    h = hashlib.blake2b(tenant.encode(), digest_size=10).digest()
    for i in range(min(MAX_CHUNKS, len(text) // CHUNK_CHARS)):
        piece = text[i * CHUNK_CHARS : (i + 1) * CHUNK_CHARS].encode("utf-8", "surrogatepass")
        h = hashlib.blake2b(h + piece, digest_size=10).digest()
        out.append(h.hex())
    return out


def matched_chunks(fingerprints: list[str], held: Any) -> int:
    """How many leading pieces of a prompt with `fingerprints` a holder of `held` (a set or
    mapping of fingerprints) has seen: the longest run, found from the end (chained hashes)."""
    for i in range(len(fingerprints) - 1, -1, -1):
        if fingerprints[i] in held:
            return i + 1
    return 0


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
