"""Object ids: `<kind>_<48 hex digits>`, e.g. `resp_…`, `conv_…`, `msg_…`.

192 random bits from `secrets`, so ids never collide and cannot be guessed: an id is also what
a client must know to read an object (on top of the tenant check).

The last `TAG_LEN` hex digits are the id's slot tag (`slot_tag`): the Redis hash tag of its
state keys (`sessions.keys`), so that on a Redis Cluster all keys a script touches lie in one
slot. An object that must share a slot with another takes that one's tag (`new_id(kind,
like=other_id)`): a response in a conversation takes the conversation's, a response chained by
`previous_response_id` takes its previous response's. Such an id still has 128 random bits.
"""

from __future__ import annotations

import secrets

TAG_LEN = 16


def new_id(kind: str, like: str | None = None) -> str:
    """A new id such as `new_id("resp")` -> `resp_3f9c…` (48 hex digits after the kind); with
    `like`, its slot tag is `like`'s (the rest stays random)."""
    if not kind.isidentifier():
        raise ValueError(f"id kind must be a short identifier, got {kind!r}")
    if like is None:
        return f"{kind}_{secrets.token_hex(24)}"
    return f"{kind}_{secrets.token_hex(24 - TAG_LEN // 2)}{slot_tag(like)}"


def slot_tag(any_id: str) -> str:
    """The id's slot tag: its last TAG_LEN characters (any string works: a foreign or short id
    gets a tag too, so a lookup of an unknown id simply finds nothing)."""
    tag = any_id[-TAG_LEN:]
    return tag.replace("{", "_").replace("}", "_")
