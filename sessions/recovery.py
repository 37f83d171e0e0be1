"""Foreground responses whose server died: found `in_progress` with no lease, written `failed`.

A stored foreground response is written `in_progress` (the response only: no items) before its
engine request starts, so `retrieve` finds it. In a conversation, its commit replaces that
record and releases the conversation's lease in one script, so a record still `in_progress`
whose conversation lease is gone (expired: nobody renewed it for `lease_ttl_ms`) or held by
another response belongs to a server that stopped. Outside a conversation (standalone or on a
`previous_response_id` chain) the response holds a lease of its own (`P:resp:r:lease`, taken
before the record is written, renewed while it runs); once that has expired, the same holds.
`settle` writes such a response `failed` (a final status, so a late commit of the same response
is refused). Items are never touched: a turn's items are only ever appended by its commit.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sessions.errors import Conflict
from sessions.models import Response, ResponseError, now
from sessions.store import SessionStore

DIED = "the server running this response stopped before it finished; nothing was added to the conversation"


async def settle(store: SessionStore, tenant: str, response: Response, running: bool) -> Response:
    """`response` as it stands: `failed` when it is an orphaned foreground turn (see the module
    docstring). `running`: this server runs it (then it is alive)."""
    if running or response.status != "in_progress" or response.background:
        return response
    if response.conversation is None:
        if await store.responses.held(response.id):
            return response  # still renewed by the server running it
    else:
        conv_id = response.conversation.id

        async def lease() -> Any:
            return await store.client.get(store.keys.lease(conv_id))

        holder = await store.retrier.run(lease, conv_id)
        if holder is not None and holder.decode().partition(":")[0] == response.id:
            return response  # still renewed by the server running it
    failed = msgspec.structs.replace(
        response, status="failed", completed_at=now(), error=ResponseError("server_error", DIED)
    )
    try:
        await store.responses.save(tenant, failed)
    except Conflict:  # committed (or settled) meanwhile
        return await store.responses.get(tenant, response.id)
    return failed
