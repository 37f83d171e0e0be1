"""What the checks of a response's creation took, given back when a later check fails."""

from __future__ import annotations

from sessions.ids import new_id
from sessions.store import SessionStore


class Undo:
    """The Idempotency-Key bound and the conversation lease taken for one response so far.

    Attributes:
        resp_id: the response's id, once bound to an Idempotency-Key (or given by a worker
            that reruns a stored response).
        lease: (conversation id, response id, fence) of the lease taken.
    """

    def __init__(self, store: SessionStore, tenant: str):
        self.store, self.tenant = store, tenant
        self.key: tuple[str, str] | None = None
        self.resp_id: str | None = None
        self.lease: tuple[str, str, int] | None = None

    async def bind(self, key: str, like: str | None = None) -> str | None:
        """Bind a new response id to `key`; the id of the key's first response if it had one."""
        resp_id = new_id("resp", like=like)
        first = await self.store.remember_idempotency(self.tenant, key, resp_id)
        if first is None:
            self.key, self.resp_id = (key, resp_id), resp_id
        return first

    async def run(self) -> None:
        if self.lease is not None:
            await self.store.conversations.release_lease(*self.lease)
        if self.key is not None:
            await self.store.forget_idempotency(self.tenant, *self.key)
