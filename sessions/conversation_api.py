"""The Conversations API: thin over the store's conversations, with the checks of its parameters.

    create(items, metadata)          POST   /v1/conversations
    get / update(metadata) / delete  GET / POST / DELETE /v1/conversations/{id}
    list_items(after, limit, order)  GET    /v1/conversations/{id}/items
    add_items(items)                 POST   /v1/conversations/{id}/items   (at most 20 a call)
    get_item / delete_item           GET / DELETE /v1/conversations/{id}/items/{item_id}

Bad parameters are `InvalidParam` naming them (`items[3].content`, `limit`, `metadata`); unknown ids
are the store's NotFound. Items are read as leniently as a response's input (`parse_input`).
"""

from __future__ import annotations

from typing import Any

from sessions.image_parts import ImageParts
from sessions.items import InvalidItem, Item, ItemPage, parse_input
from sessions.models import Conversation
from sessions.requests import InvalidParam, check_metadata
from sessions.store import SessionStore


def check_page(limit: int, order: str) -> None:
    """InvalidParam unless 1 <= limit <= 100 and order is asc or desc."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
        raise InvalidParam("limit", f"must be an integer in 1..100, got {limit!r}")
    if order not in ("asc", "desc"):
        raise InvalidParam("order", f"must be 'asc' or 'desc', got {order!r}")


class ConversationAPI:
    """The Conversations API for one store (see the module docstring)."""

    def __init__(self, store: SessionStore):
        self.store = store
        self.images: ImageParts | None = None  # checks image parts (set by the session service)

    def _items(self, raw: Any) -> list[Item]:
        if raw is None:
            return []
        try:
            items = parse_input(raw if isinstance(raw, list) else [raw])
        except InvalidItem as e:
            raise InvalidParam(e.param.replace("input", "items", 1), e.message) from None
        limit = self.store.config.max_append
        if len(items) > limit:
            raise InvalidParam("items", f"at most {limit} items per call, got {len(items)}")
        return items

    async def create(self, tenant: str, items: Any = None, metadata: Any = None) -> Conversation:
        parsed, meta = self._items(items), check_metadata(metadata)
        if self.images is not None:
            await self.images.check_items(parsed, "items")
        return (await self.store.conversations.create(tenant, meta, parsed)).conversation

    async def get(self, tenant: str, conv_id: str) -> Conversation:
        return (await self.store.conversations.get(tenant, conv_id)).conversation

    async def update(self, tenant: str, conv_id: str, metadata: Any) -> Conversation:
        meta = check_metadata(metadata)
        return (await self.store.conversations.update(tenant, conv_id, meta)).conversation

    async def delete(self, tenant: str, conv_id: str) -> dict[str, Any]:
        await self.store.conversations.get(tenant, conv_id)  # NotFound for an unknown id
        await self.store.conversations.delete(tenant, conv_id)
        return {"id": conv_id, "object": "conversation.deleted", "deleted": True}

    async def list_items(
        self, tenant: str, conv_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> ItemPage:
        check_page(limit, order)
        return await self.store.conversations.list_items(tenant, conv_id, after, limit, order)  # type: ignore[arg-type]

    async def add_items(self, tenant: str, conv_id: str, items: Any) -> ItemPage:
        """Append items; the page holds exactly them (`has_more` false)."""
        parsed = self._items(items)
        if not parsed:
            raise InvalidParam("items", "expected at least one item")
        if self.images is not None:
            await self.images.check_items(parsed, "items")
        await self.store.conversations.append_items(tenant, conv_id, parsed)
        return ItemPage.of(parsed, False)

    async def get_item(self, tenant: str, conv_id: str, item_id: str) -> Item:
        return await self.store.conversations.get_item(tenant, conv_id, item_id)

    async def delete_item(self, tenant: str, conv_id: str, item_id: str) -> Conversation:
        """Remove an item; returns the conversation (as the API does)."""
        await self.store.conversations.delete_item(tenant, conv_id, item_id)
        return await self.get(tenant, conv_id)
