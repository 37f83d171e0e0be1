"""`longctx state migrate`: a database in the layout before hash tags is refused at start with
the command to run, and after the command its conversations and responses read as before."""

from __future__ import annotations

import asyncio

import pytest
import redis

from api.cli import main
from sessions.errors import UnsuitableServer
from sessions.items import Message, OutputText, parse_item
from sessions.migrate import old_name
from sessions.models import ConversationRef, Response, new_id
from sessions.store import SessionStore, StoreConfig
from tests.redis_server import shared_redis


def _to_old_layout(url: str, prefix: str) -> None:
    """Rename every tagged key back to the old names, with one global fence counter."""
    r = redis.Redis.from_url(url)
    for raw in list(r.scan_iter(match=f"{prefix}:{{*", count=1000)):
        key = raw.decode()
        _, rest = key[len(prefix) + 1 :].split("}:", 1)
        r.rename(key, f"{prefix}:{rest}")
        if rest.startswith("conv:") and rest.count(":") == 1:
            r.hdel(f"{prefix}:{rest}", "fence")
    r.set(f"{prefix}:fence", 41)
    r.delete(f"{prefix}:layout")


def test_old_layout_is_refused_then_migrated() -> None:
    assert old_name("lc", "lc:conv:conv_1:items") == ("conv", "conv_1", ":items")

    with shared_redis() as (url, prefix):

        async def write() -> tuple[str, str]:
            store = SessionStore.connect(url, StoreConfig(prefix=prefix))
            try:
                await store.check_server()
                state = await store.conversations.create("t", items=[parse_item({"role": "user", "content": "hi"})])
                cid = state.conversation.id
                out = [Message(id=new_id("msg"), role="assistant", content=[OutputText(text="hello")])]
                r = Response(model="m", status="completed", output=out, conversation=ConversationRef(cid))  # type: ignore[arg-type]
                fence = await store.conversations.acquire_lease("t", cid, r.id)
                await store.conversations.commit_turn(
                    "t", cid, fence, r, [], base_version=state.version, prompt_ids=[5], output_ids=[6]
                )
                return cid, r.id
            finally:
                await store.close()

        cid, rid = asyncio.run(write())
        _to_old_layout(url, prefix)

        async def check(expect_refusal: bool) -> None:
            store = SessionStore.connect(url, StoreConfig(prefix=prefix))
            try:
                if expect_refusal:
                    with pytest.raises(UnsuitableServer, match="longctx state migrate"):
                        await store.check_server()
                    return
                await store.check_server()
                ctx = await store.conversations.load("t", cid)
                assert ctx.last_response_id == rid and ctx.prompt_ids == [5] and len(ctx.items) == 2
                assert (await store.responses.get("t", rid)).output[0].content[0].text == "hello"  # type: ignore[union-attr]
                assert await store.conversations.acquire_lease("t", cid, new_id("resp")) > 41
            finally:
                await store.close()

        asyncio.run(check(True))
        assert main(["state", "migrate", "--redis-url", url, "--redis-prefix", prefix]) == 0
        assert main(["state", "migrate", "--redis-url", url, "--redis-prefix", prefix]) == 0  # twice: no change
        asyncio.run(check(False))
