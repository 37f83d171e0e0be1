"""Responses in Redis: `P:{t}:resp:r` (hash) and `…:items` (its input items); layout and
rules in `sessions.store`. A response in a conversation is written by the conversation's
`commit_turn`; any response (or a snapshot of a running one) by `ResponseStore.save`.

The hash keeps what the next turn of a `previous_response_id` chain needs: the response JSON
(with its output), `prev` (the link), `input_ids` (its input items, in order), and the token
ids of its prompt and output (uint32 little-endian), so the next prompt is those tokens plus
the rendering of the new items only.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import msgspec
from redis.asyncio import Redis

from sessions.config import StoreConfig
from sessions.errors import NotFound
from sessions.image_store import image_args, load_items, store_items
from sessions.items import Item, ItemPage, check_page
from sessions.keys import Keys
from sessions.models import Response, decode_response
from sessions.retry import Retrier
from sessions.scripts import Scripts

Order = Literal["asc", "desc"]


class ChainLink(NamedTuple):
    response: Response
    input_items: list[Item]


class Chain(NamedTuple):
    """A `previous_response_id` chain, oldest first: the next turn's context is each link's
    input items then its output. `prompt_ids`/`output_ids` are the newest response's tokens
    (None if it stored none)."""

    links: list[ChainLink]
    prompt_ids: list[int] | None
    output_ids: list[int] | None


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes (4 bytes a token)."""
    a = array("I", ids)
    assert a.itemsize == 4
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_ids(raw: bytes | None) -> list[int] | None:
    """Inverse of `pack_ids`; None stays None (nothing stored)."""
    if raw is None:
        return None
    a = array("I")
    a.frombytes(raw)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def response_fields(
    response: Response,
    input_items: Sequence[Item] | None,
    prompt_ids: Sequence[int] | None,
    output_ids: Sequence[int] | None,
) -> list[Any]:
    """Hash fields `field, value, …` of a response beside its JSON; what is None is left as is."""
    conv = response.conversation.id if response.conversation else ""
    fields: list[Any] = ["prev", response.previous_response_id or "", "conv", conv]
    if input_items is not None:
        fields += ["input_ids", msgspec.json.encode([item.id for item in input_items])]
    if prompt_ids is not None:
        fields += ["prompt_ids", pack_ids(prompt_ids)]
    if output_ids is not None:
        fields += ["output_ids", pack_ids(output_ids)]
    return fields


class ResponseStore:
    """Stored responses; built by `SessionStore` (as `store.responses`)."""

    def __init__(self, client: Redis, keys: Keys, retrier: Retrier, scripts: Scripts, config: StoreConfig):
        self.client, self.keys, self.retrier, self.scripts, self.config = client, keys, retrier, scripts, config

    async def save(
        self,
        tenant: str,
        response: Response,
        input_items: Sequence[Item] | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        output_ids: Sequence[int] | None = None,
    ) -> None:
        """Store a response (outside a conversation, or a snapshot of a running one) with its
        input items and tokens. A final response is never overwritten: Conflict (unless the
        same JSON is written again: a replay)."""
        fields = response_fields(response, input_items, prompt_ids, output_ids)
        items = list(input_items or ())
        stored = store_items(items)
        args = [tenant, self.config.state_ttl_s, response.status, msgspec.json.encode(response)]
        args += [len(fields) // 2, len(items), *fields, *stored.pairs, *image_args(stored)]
        keys = [self.keys.resp(response.id), self.keys.resp_items(response.id), self.keys.resp_images(response.id)]
        await self.retrier.script(self.scripts.save_response, keys, args, response.id)

    async def hold(self, resp_id: str) -> None:
        """Mark a running foreground response outside a conversation alive for `lease_ttl_ms`
        (taken before its `in_progress` record is written, renewed while it runs; a response
        whose mark expired belongs to a server that stopped: `sessions.recovery`)."""

        async def once() -> Any:
            return await self.client.set(self.keys.resp_lease(resp_id), b"1", px=self.config.lease_ttl_ms)

        await self.retrier.run(once, resp_id)

    async def release(self, resp_id: str) -> None:
        """Drop the mark once the response is final (it would expire by itself)."""

        async def once() -> Any:
            return await self.client.delete(self.keys.resp_lease(resp_id))

        await self.retrier.run(once, resp_id)

    async def held(self, resp_id: str) -> bool:
        async def once() -> Any:
            return await self.client.exists(self.keys.resp_lease(resp_id))

        return bool(await self.retrier.run(once, resp_id))

    async def get(self, tenant: str, resp_id: str) -> Response:
        """The response; NotFound if absent or another tenant's."""

        async def once() -> list[Any]:
            return await self.client.hmget(self.keys.resp(resp_id), ["tenant", "response"])

        owner, body = await self.retrier.run(once, resp_id)
        if owner is None or owner.decode() != tenant or body is None:
            raise NotFound("response", resp_id)
        return decode_response(body)

    async def list_input_items(
        self, tenant: str, resp_id: str, after: str | None = None, limit: int = 20, order: Order = "desc"
    ) -> ItemPage:
        """A page of the response's input items (`GET /v1/responses/{id}/input_items`)."""
        check_page(limit, order)
        keys = [self.keys.resp(resp_id), self.keys.resp_items(resp_id)]
        bodies, images = await self.retrier.script(self.scripts.response_items, keys, [tenant], resp_id)
        items = load_items(bodies, images)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise NotFound("item", after)
            items = items[ids.index(after) + 1 :]
        return ItemPage.of(items[:limit], len(items) > limit)

    async def load_chain(self, tenant: str, resp_id: str) -> Chain:
        """Every response of the `previous_response_id` chain ending at `resp_id`, oldest first,
        with its input items, in one round trip (one script). Raises NotFound naming the first
        missing (or foreign) link, ChainTooLong past `max_chain` responses."""
        args = [self.keys.prefix, tenant, resp_id, self.config.max_chain]
        keys = [self.keys.resp(resp_id)]
        prompt, output, *links = await self.retrier.script(self.scripts.load_chain, keys, args, resp_id)
        chain = [ChainLink(decode_response(body), load_items(items, images)) for body, items, images in reversed(links)]
        return Chain(chain, unpack_ids(prompt), unpack_ids(output))

    async def delete(self, tenant: str, resp_id: str) -> None:
        """Delete a response, its input items and its events; NotFound if absent."""
        keys = [self.keys.resp(resp_id), self.keys.resp_items(resp_id), self.keys.events(resp_id)]
        keys.append(self.keys.resp_images(resp_id))
        await self.retrier.script(self.scripts.delete_response, keys, [tenant], resp_id, gone_ok=True)
