"""Object ids: `<kind>_<48 hex digits>`, e.g. `resp_…`, `conv_…`, `msg_…`.

192 random bits from `secrets`, so ids never collide and cannot be guessed: an id is also what
a client must know to read an object (on top of the tenant check).
"""

from __future__ import annotations

import secrets


def new_id(kind: str) -> str:
    """A new id such as `new_id("resp")` -> `resp_3f9c…` (48 hex digits after the kind)."""
    if not kind.isidentifier():
        raise ValueError(f"id kind must be a short identifier, got {kind!r}")
    return f"{kind}_{secrets.token_hex(24)}"
