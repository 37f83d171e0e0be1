"""The Conversations API over a real Redis, as the OpenAI Agents SDK's session drives it (create,
add items in batches, page with `after` until `has_more` is false, pop with desc + delete, clear),
and bad parameters named (`limit`, `order`, `items[i]...`, `metadata`) with nothing written."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from sessions.conversation_api import ConversationAPI
from sessions.errors import NotFound
from sessions.items import Message, text_of
from sessions.requests import InvalidParam
from sessions.store import SessionStore, StoreConfig
from tests.redis_server import shared_redis

T = TypeVar("T")
TENANT = "t1"


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


def run(target: tuple[str, str], body: Callable[[ConversationAPI], Awaitable[T]]) -> T:
    async def main() -> T:
        store = SessionStore.connect(target[0], StoreConfig(prefix=target[1]))
        try:
            return await body(ConversationAPI(store))
        finally:
            await store.close()

    return asyncio.run(main())


def test_sdk_session_flow(target: tuple[str, str]) -> None:
    async def body(api: ConversationAPI) -> None:
        conv = await api.create(TENANT, [], {"topic": "x"})
        assert conv.metadata == {"topic": "x"} and conv.id.startswith("conv_")
        for start in range(0, 25, 5):  # user messages as {"role", "content"} without type
            page = await api.add_items(
                TENANT, conv.id, [{"role": "user", "content": f"m{i}"} for i in range(start, start + 5)]
            )
            assert [text_of(i) for i in page.items] == [f"m{i}" for i in range(start, start + 5)] and not page.has_more
        seen: list[str] = []
        after = None
        while True:
            page = await api.list_items(TENANT, conv.id, after=after, limit=7, order="asc")
            seen += [text_of(i) for i in page.items]
            if not page.has_more:
                break
            after = page.last_id
        assert seen == [f"m{i}" for i in range(25)]
        last = (await api.list_items(TENANT, conv.id, limit=1, order="desc")).items[0]
        assert isinstance(last, Message) and text_of(last) == "m24"
        assert (await api.get_item(TENANT, conv.id, last.id)) == last
        assert (await api.delete_item(TENANT, conv.id, last.id)).id == conv.id
        assert text_of((await api.list_items(TENANT, conv.id, limit=1)).items[0]) == "m23"
        assert (await api.update(TENANT, conv.id, {"topic": "y"})).metadata == {"topic": "y"}
        assert (await api.delete(TENANT, conv.id))["deleted"] is True
        with pytest.raises(NotFound):
            await api.get(TENANT, conv.id)
        with pytest.raises(NotFound):
            await api.delete(TENANT, conv.id)

    run(target, body)


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda api, c: api.list_items(TENANT, c, limit=0), "limit"),
        (lambda api, c: api.list_items(TENANT, c, limit=101), "limit"),
        (lambda api, c: api.list_items(TENANT, c, order="up"), "order"),
        (lambda api, c: api.add_items(TENANT, c, [{"role": "user", "content": "ok"}, {"role": "user", "content": 5}]),
         "items[1].content"),
        (lambda api, c: api.add_items(TENANT, c, [{"role": "user", "content": "x"}] * 21), "items"),
        (lambda api, c: api.add_items(TENANT, c, []), "items"),
        (lambda api, c: api.update(TENANT, c, {str(i): "v" for i in range(17)}), "metadata"),
        (lambda api, c: api.update(TENANT, c, {"k": 1}), "metadata"),
        (lambda api, c: api.create(TENANT, [{"type": "nope"}]), "items[0]"),
    ],
)  # fmt: skip
def test_bad_parameters_are_named(target: tuple[str, str], call: Callable[..., Awaitable[Any]], param: str) -> None:
    async def body(api: ConversationAPI) -> None:
        conv = await api.create(TENANT, [{"role": "user", "content": "hi"}])
        with pytest.raises(InvalidParam) as e:
            await call(api, conv.id)
        assert e.value.param.startswith(param), e.value
        state = await api.store.conversations.get(TENANT, conv.id)
        assert state.version == 1 and state.conversation.metadata == {}

    run(target, body)
