"""The session store when Redis fails: a stopped or stalled server costs a call the retry budget,
then StoreUnavailable; a server back within the budget answers the call; data kept by an append-only
server is there after its restart; a server that evicts keys is refused at start."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sessions.errors import StoreUnavailable, UnsuitableServer
from sessions.items import Item, parse_item, text_of
from sessions.store import SessionStore, StoreConfig
from tests.redis_process import restartable_redis
from tests.redis_server import private_redis


def user(text: str) -> Item:
    return parse_item({"role": "user", "content": text})


def test_retries_then_unavailable_then_recovers() -> None:
    with restartable_redis() as server:

        async def body() -> None:
            store = SessionStore.connect(server.url, StoreConfig(retry_budget_s=1.0))
            cid = (await store.conversations.create("t", items=[user("kept")])).conversation.id
            server.stop()
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.conversations.get("t", cid)
            assert 0.9 < time.monotonic() - start < 3.0  # the budget, tried again and again
            with pytest.raises(StoreUnavailable):
                await store.conversations.append_items("t", cid, [user("lost")])

            restart = threading.Timer(0.3, server.start)  # back while the next call still retries
            restart.start()
            patient = SessionStore(store.client, StoreConfig(retry_budget_s=8.0))
            items = (await patient.conversations.load("t", cid)).items
            restart.join()
            assert [text_of(i) for i in items] == ["kept"]  # written before the stop, kept by the AOF
            await store.conversations.append_items("t", cid, [user("after restart")])
            items = (await store.conversations.load("t", cid)).items
            assert [text_of(i) for i in items] == ["kept", "after restart"]
            await store.close()

        asyncio.run(body())


def test_a_stalled_server_costs_the_budget_not_a_socket_timeout() -> None:
    with restartable_redis() as server:

        async def body() -> None:
            store = SessionStore.connect(server.url, StoreConfig(retry_budget_s=1.0))
            cid = (await store.conversations.create("t", items=[user("kept")])).conversation.id
            server.pause()
            try:
                start = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await store.conversations.load("t", cid)
                assert time.monotonic() - start < 2.0  # the socket timeout is 10 s
            finally:
                server.pause(False)
            assert [text_of(i) for i in (await store.conversations.load("t", cid)).items] == ["kept"]
            await store.close()

        asyncio.run(body())


def test_check_server_refuses_an_evicting_redis() -> None:
    for args, ok in ((("--maxmemory-policy", "allkeys-lru"), False), ((), True)):
        with private_redis(*args) as url:

            async def body(url: str = url) -> None:
                store = SessionStore.connect(url)
                try:
                    await store.check_server()
                finally:
                    await store.close()

            if ok:
                asyncio.run(body())
            else:
                with pytest.raises(UnsuitableServer, match="noeviction"):
                    asyncio.run(body())
