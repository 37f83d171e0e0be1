"""`longctx state migrate`: rewrite a single-server state database from the key layout before
hash tags (`P:conv:c…`, `P:resp:r…`, one `P:fence` counter) to today's (`sessions.store`).

Each key is RENAMEd (its value and TTL move as they are) to its tagged name; each conversation
hash gets the field `fence` set to the old global counter, so a fence handed out before stays
below every later one; `P:fence` is then deleted and `P:layout` set. Response ids written before
do not share their conversation's tag, so a migrated database stays on one Redis (a Cluster
takes a new database). Run it with the servers stopped; running it twice changes nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sessions.keys import LAYOUT, Keys

_KINDS = ("conv", "resp")


class Migrated(NamedTuple):
    keys: int  # keys renamed
    conversations: int
    responses: int


def old_name(prefix: str, key: str) -> tuple[str, str, str] | None:
    """(kind, id, suffix) of an old-layout key `P:<kind>:<id><suffix>`, else None."""
    for kind in _KINDS:
        head = f"{prefix}:{kind}:"
        if key.startswith(head):
            rest = key[len(head) :]
            oid, sep, tail = rest.partition(":")
            return kind, oid, sep + tail
    return None


def migrate(client: Any, prefix: str) -> Migrated:
    """Migrate the database behind the blocking client `client` (see the module docstring)."""
    keys = Keys(prefix)
    fence = int(client.get(f"{prefix}:fence") or 0)
    renamed, convs, resps = 0, 0, 0
    for kind in _KINDS:
        for raw in list(client.scan_iter(match=f"{prefix}:{kind}:*", count=1000)):
            key = raw.decode()
            parsed = old_name(prefix, key)
            if parsed is None:
                continue
            _, oid, suffix = parsed
            new = (keys.conv(oid) if kind == "conv" else keys.resp(oid)) + suffix
            client.rename(key, new)
            renamed += 1
            if suffix == "":
                if kind == "conv":
                    convs += 1
                    client.hsetnx(new, "fence", fence)
                else:
                    resps += 1
    client.delete(f"{prefix}:fence")
    client.set(keys.layout, LAYOUT)
    return Migrated(renamed, convs, resps)
