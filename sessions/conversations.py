"""Conversations in Redis: their items, their lease, and the commit of a turn. Keys
`P:{t}:conv:c` (hash), `…:order` (zset), `…:items` (hash), `…:lease`; layout and rules in
`sessions.store`.

A turn on a conversation runs as: `acquire_lease` (the fence; ConversationBusy if another
response runs), `load` (items, version, the last turn's tokens), `renew_lease` every few
seconds while generating, then `commit_turn` with the fence and the version it loaded:
input + output items appended, response written, lease released, all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
from redis.asyncio import Redis

from sessions.config import StoreConfig
from sessions.errors import NotFound
from sessions.image_store import image_args, image_map, load_item, load_items, store_items
from sessions.items import Item, ItemPage, check_page
from sessions.keys import Keys
from sessions.models import Conversation, ConversationState, Response, new_id, now
from sessions.responses import Order, response_fields, unpack_ids
from sessions.retry import Retrier
from sessions.scripts import Scripts


class ConversationContext(NamedTuple):
    """All a turn needs from a conversation. `prompt_ids` + `output_ids` are the tokens of
    `last_response_id`, whose prompt and output rendered exactly the items up to its last
    output item (any later items were appended after it). All three are None when there is no
    such response: none committed yet, or items changed under a turn, or an item was deleted."""

    state: ConversationState
    items: list[Item]
    last_response_id: str | None
    prompt_ids: list[int] | None
    output_ids: list[int] | None


def _metadata(raw: bytes | None) -> dict[str, str]:
    return msgspec.json.decode(raw or b"{}", type=dict[str, str])


class ConversationStore:
    """Stored conversations; built by `SessionStore` (as `store.conversations`)."""

    def __init__(self, client: Redis, keys: Keys, retrier: Retrier, scripts: Scripts, config: StoreConfig):
        self.client, self.keys, self.retrier, self.scripts, self.config = client, keys, retrier, scripts, config

    def _check_append(self, items: Sequence[Item]) -> None:
        if len(items) > self.config.max_append:
            raise ValueError(f"at most {self.config.max_append} items per call, got {len(items)}")

    async def create(
        self, tenant: str, metadata: dict[str, str] | None = None, items: Sequence[Item] = ()
    ) -> ConversationState:
        """A new conversation (`conv_…`) holding `items` (at most `max_append`)."""
        self._check_append(items)
        conv = Conversation(id=new_id("conv"), created_at=now(), metadata=metadata or {})
        stored = store_items(items)
        args = [tenant, conv.created_at, msgspec.json.encode(conv.metadata), self.config.state_ttl_s]
        args += [len(items), *stored.pairs, *image_args(stored)]
        keys = self.keys.conversation(conv.id)
        version = await self.retrier.script(self.scripts.create_conversation, keys, args, conv.id)
        return ConversationState(conv, tenant, int(version))

    async def get(self, tenant: str, conv_id: str) -> ConversationState:
        """The conversation with its version; NotFound if absent or another tenant's."""

        async def once() -> list[Any]:
            return await self.client.hmget(self.keys.conv(conv_id), ["tenant", "created_at", "metadata", "version"])

        owner, created_at, metadata, version = await self.retrier.run(once, conv_id)
        if owner is None or owner.decode() != tenant:
            raise NotFound("conversation", conv_id)
        conv = Conversation(id=conv_id, created_at=int(created_at), metadata=_metadata(metadata))
        return ConversationState(conv, tenant, int(version))

    async def update(self, tenant: str, conv_id: str, metadata: dict[str, str]) -> ConversationState:
        """Replace the conversation's metadata (the version, which counts item changes, stays)."""
        args = [tenant, self.config.state_ttl_s, msgspec.json.encode(metadata)]
        await self.retrier.script(self.scripts.update_conversation, self.keys.conversation(conv_id), args, conv_id)
        return await self.get(tenant, conv_id)

    async def delete(self, tenant: str, conv_id: str) -> None:
        """Delete the conversation, its items and its lease (a running turn then gets LeaseLost)."""
        keys = [*self.keys.conversation(conv_id), self.keys.lease(conv_id)]
        await self.retrier.script(self.scripts.delete_conversation, keys, [tenant], conv_id, gone_ok=True)

    async def load(self, tenant: str, conv_id: str) -> ConversationContext:
        """The conversation, all its items in order and its last turn's tokens, in one round trip."""
        keys, args = self.keys.conversation(conv_id), [tenant, self.keys.prefix]
        reply = await self.retrier.script(self.scripts.load_conversation, keys, args, conv_id)
        created_at, metadata, version, last, prompt, output, bodies, images = reply
        conv = Conversation(id=conv_id, created_at=int(created_at), metadata=_metadata(metadata))
        state = ConversationState(conv, tenant, int(version))
        items = load_items(bodies, images)
        if not last or prompt is None:
            return ConversationContext(state, items, None, None, None)
        return ConversationContext(state, items, last.decode(), unpack_ids(prompt), unpack_ids(output))

    # ---- items ----

    async def append_items(self, tenant: str, conv_id: str, items: Sequence[Item]) -> int:
        """Append items (at most `max_append`) and return the new version. Conflict if some ids
        are in the conversation already; if all are, the call is a replay and changes nothing."""
        self._check_append(items)
        stored = store_items(items)
        args = [tenant, self.config.state_ttl_s, len(items), *stored.pairs, *image_args(stored)]
        return int(await self.retrier.script(self.scripts.append_items, self.keys.conversation(conv_id), args, conv_id))

    async def get_item(self, tenant: str, conv_id: str, item_id: str) -> Item:
        """One item; NotFound (kind "conversation" or "item") if absent."""
        keys, args = [self.keys.conv(conv_id), self.keys.items(conv_id)], [tenant, item_id]
        body, images = await self.retrier.script(self.scripts.get_item, keys, args, conv_id)
        return load_item(body, image_map(images))

    async def delete_item(self, tenant: str, conv_id: str, item_id: str) -> None:
        """Remove an item (NotFound if absent); the version goes up."""
        args = [tenant, self.config.state_ttl_s, item_id]
        keys = self.keys.conversation(conv_id)
        await self.retrier.script(self.scripts.delete_item, keys, args, conv_id, gone_ok=True)

    async def list_items(
        self, tenant: str, conv_id: str, after: str | None = None, limit: int = 20, order: Order = "desc"
    ) -> ItemPage:
        """A page of items after item `after` (NotFound if it is not there), in position order
        `asc` or `desc` (the API's default), `limit` 1..100."""
        check_page(limit, order)
        args = [tenant, after or "", limit, "1" if order == "desc" else "0"]
        keys = self.keys.conversation(conv_id)
        more, bodies, images = await self.retrier.script(self.scripts.list_items, keys, args, conv_id)
        return ItemPage.of(load_items(bodies, images), bool(more))

    # ---- the lease and the commit of a turn ----

    async def acquire_lease(self, tenant: str, conv_id: str, resp_id: str) -> int:
        """Take the conversation for `resp_id` for `lease_ttl_ms` and return the fence.
        ConversationBusy while another response holds it; the same response takes it over
        with a new fence (its earlier holder then gets LeaseLost)."""
        keys = [self.keys.conv(conv_id), self.keys.lease(conv_id)]
        args = [tenant, resp_id, self.config.lease_ttl_ms]
        return int(await self.retrier.script(self.scripts.acquire_lease, keys, args, conv_id))

    async def renew_lease(self, conv_id: str, resp_id: str, fence: int) -> None:
        """Extend the lease by `lease_ttl_ms`; LeaseLost if this fence no longer holds it."""
        args = [f"{resp_id}:{fence}", self.config.lease_ttl_ms]
        await self.retrier.script(self.scripts.renew_lease, [self.keys.lease(conv_id)], args, conv_id)

    async def release_lease(self, conv_id: str, resp_id: str, fence: int) -> bool:
        """Give the lease back without a commit; False if this fence did not hold it."""
        args = [f"{resp_id}:{fence}"]
        return bool(await self.retrier.script(self.scripts.release_lease, [self.keys.lease(conv_id)], args, conv_id))

    async def commit_turn(
        self,
        tenant: str,
        conv_id: str,
        fence: int,
        response: Response,
        input_items: Sequence[Item],
        *,
        base_version: int | None = None,
        prompt_ids: Sequence[int] | None = None,
        output_ids: Sequence[int] | None = None,
        append: bool = True,
    ) -> int:
        """Atomically: check that `fence` still holds the lease, append `input_items` then
        `response.output` to the conversation (not if `append` is False: a failed turn leaves
        the items unchanged), write the response with its input items and tokens, release the
        lease. A failed check writes nothing.

        Args:
            base_version: the version `load` returned for this turn; if the items did not change
                since, this response becomes the conversation's last response (its tokens are
                the next turn's prompt prefix).
            prompt_ids, output_ids: this turn's token ids.
        Returns:
            The conversation's version after the commit.
        Raises:
            LeaseLost (fence no longer holds the lease), Conflict (the response is already final,
            or an item id is in the conversation already), NotFound.
        """
        fields = response_fields(response, input_items, prompt_ids, output_ids)
        new = store_items([*input_items, *response.output] if append else [])
        inputs = store_items(input_items)
        args: list[Any] = [tenant, self.config.state_ttl_s, f"{response.id}:{fence}"]
        args += ["" if base_version is None else str(base_version), response.id, response.status]
        args += [msgspec.json.encode(response), "1" if append else "0", len(new.pairs) // 2, len(fields) // 2]
        args += [len(input_items), *new.pairs, *fields, *inputs.pairs, *image_args(new, inputs)]
        keys = [*self.keys.conversation(conv_id), self.keys.lease(conv_id)]
        keys += [self.keys.resp(response.id), self.keys.resp_items(response.id), self.keys.resp_images(response.id)]
        return int(await self.retrier.script(self.scripts.commit_turn, keys, args, conv_id))
