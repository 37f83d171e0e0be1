"""The session store against a real Redis: every item type round-trips in the forms the OpenAI
Agents SDK sends, paging as the SDK pages, leases and fenced commits (a failed check writes
nothing), concurrent committers, tenant isolation, response chains, idempotency. Elsewhere: the
randomized interleaving of two actors (test_session_interleaving.py), events and jobs
(test_session_streams.py), a Redis that stops or evicts (test_session_faults.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar, cast

import msgspec
import pytest
import redis

from sessions.errors import (
    ChainTooLong,
    Conflict,
    ConversationBusy,
    LeaseLost,
    NotFound,
)
from sessions.items import Item, Message, OutputText, parse_input, parse_item
from sessions.models import ConversationRef, Response, new_id
from sessions.store import SessionStore, StoreConfig
from tests.redis_server import shared_redis
from tests.test_session_models import SDK_INPUT

T = TypeVar("T")


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


def run(target: tuple[str, str], body: Callable[[SessionStore], Awaitable[T]], **config: Any) -> T:
    """Run `body` on a fresh store (and event loop) under the test prefix."""

    async def main() -> T:
        store = SessionStore.connect(target[0], StoreConfig(prefix=target[1], **config))
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def dump(url: str, prefix: str) -> dict[bytes, Any]:
    """Every key of ours with its contents (by type: DUMP bytes of a hash depend on its layout)."""
    r = redis.Redis.from_url(url)
    read: dict[bytes, Callable[[bytes], Any]] = {
        b"string": r.get,
        b"hash": r.hgetall,
        b"zset": lambda k: r.zrange(k, 0, -1, withscores=True),
        b"stream": r.xrange,
    }
    return {k: read[r.type(k)](k) for k in r.scan_iter(match=f"{prefix}*", count=1000)}  # type: ignore[index]


def user(text: str) -> Item:
    return parse_item({"role": "user", "content": text})


def reply(conv_id: str | None, text: str = "ok", **kw: Any) -> Response:
    output = [Message(id=new_id("msg"), role="assistant", content=[OutputText(text=text)])]
    conv = ConversationRef(conv_id) if conv_id else None
    return Response(**{"model": "m", "status": "completed", "output": output, "conversation": conv, **kw})


def test_every_item_type_round_trips_in_sdk_forms(target: tuple[str, str]) -> None:
    items = parse_input(SDK_INPUT)

    async def body(store: SessionStore) -> list[bytes]:
        cid = (await store.conversations.create("t", {"k": "v"}, items)).conversation.id
        page = await store.conversations.list_items("t", cid, order="asc", limit=100)
        assert page.items == items and not page.has_more
        assert [await store.conversations.get_item("t", cid, i.id) for i in items] == items
        return cast(list[bytes], await store.client.hvals(store.keys.items(cid)))

    stored = {msgspec.json.decode(b)["id"]: msgspec.json.decode(b) for b in run(target, body)}
    kinds = [stored[i.id]["type"] for i in items]
    assert kinds == ["message"] * 4 + ["function_call", "function_call_output", "reasoning", "compaction", "message"]
    assert stored["msg_1"]["phase"] == "commentary"
    assert stored["msg_1"]["content"] == [
        {"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}
    ]
    last = stored[items[-1].id]
    assert "phase" not in last and last["status"] == "completed" and last["id"].startswith("msg_")
    assert last["content"] == [{"type": "output_text", "text": "Sunny.", "annotations": []}]
    assert stored[items[0].id]["content"] == [{"type": "input_text", "text": "What is the weather in Paris?"}]
    assert stored["fc_1"]["arguments"] == '{"city": "Paris"}' and "created_at" not in stored["fc_1"]
    assert stored[items[5].id]["id"].startswith("fco_") and "encrypted_content" not in stored["rs_1"]


def test_paging_asc_and_desc_with_after(target: tuple[str, str]) -> None:
    items = [user(str(i)) for i in range(25)]

    async def pages(store: SessionStore, cid: str, order: Any) -> list[tuple[list[str], bool]]:
        out, after = [], None
        while True:  # as the SDK pages: after=last_id until has_more is false
            page = await store.conversations.list_items("t", cid, after=after, limit=10, order=order)
            out.append(([i.id for i in page.items], page.has_more))
            assert page.first_id == (page.items[0].id if page.items else None)
            if not page.has_more:
                return out
            after = page.last_id

    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t")).conversation.id
        await store.conversations.append_items("t", cid, items[:20])
        await store.conversations.append_items("t", cid, items[20:])
        await store.conversations.delete_item("t", cid, items[7].id)
        ids = [i.id for i in items if i is not items[7]]
        asc, desc = await pages(store, cid, "asc"), await pages(store, cid, "desc")
        assert [len(p) for p, _ in asc] == [10, 10, 4] and [m for _, m in asc] == [True, True, False]
        assert [i for p, _ in asc for i in p] == ids and [i for p, _ in desc for i in p] == ids[::-1]
        with pytest.raises(NotFound):
            await store.conversations.list_items("t", cid, after=items[7].id)
        for bad in (0, 101):
            with pytest.raises(ValueError):
                await store.conversations.list_items("t", cid, limit=bad)
        with pytest.raises(ValueError):
            await store.conversations.append_items("t", cid, [user("x") for _ in range(21)])

    run(target, body)


def test_lease_busy_takeover_and_fences(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t")).conversation.id
        r1, r2 = new_id("resp"), new_id("resp")
        got = await asyncio.gather(
            *(store.conversations.acquire_lease("t", cid, r) for r in (r1, r2)), return_exceptions=True
        )
        assert sorted(type(g).__name__ for g in got) == ["ConversationBusy", "int"]
        holder = r1 if isinstance(got[0], int) else r2
        other = r2 if holder == r1 else r1
        with pytest.raises(ConversationBusy) as busy:
            await store.conversations.acquire_lease("t", cid, other)
        assert busy.value.holder == holder
        old = next(g for g in got if isinstance(g, int))
        new = await store.conversations.acquire_lease("t", cid, holder)  # the same response takes over
        assert new > old
        with pytest.raises(LeaseLost):
            await store.conversations.renew_lease(cid, holder, old)
        await store.conversations.renew_lease(cid, holder, new)
        assert not await store.conversations.release_lease(cid, holder, old)
        assert await store.conversations.release_lease(cid, holder, new)
        await store.conversations.acquire_lease("t", cid, other)

    run(target, body)


def test_failed_commits_write_nothing(target: tuple[str, str]) -> None:
    url, prefix = target

    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t", items=[user("hi")])).conversation.id
        r1 = reply(cid)
        f1 = await store.conversations.acquire_lease("t", cid, r1.id)
        await asyncio.sleep(0.25)  # the lease expires; another response takes the conversation
        # ... and holds it for 30 s, so that a loaded machine cannot let it expire mid-test
        store.conversations.config = dataclasses.replace(store.conversations.config, lease_ttl_ms=30_000)
        r2 = reply(cid)
        f2 = await store.conversations.acquire_lease("t", cid, r2.id)
        before = dump(url, prefix)
        with pytest.raises(LeaseLost):
            await store.conversations.commit_turn("t", cid, f1, r1, [user("late")], base_version=1)
        assert dump(url, prefix) == before
        existing = (await store.conversations.list_items("t", cid)).items[0]
        with pytest.raises(Conflict):  # an item id already in the conversation
            await store.conversations.commit_turn("t", cid, f2, r2, [existing, user("new")])
        assert dump(url, prefix) == before
        await store.responses.save("t", reply(cid, status="failed", id=r2.id))  # type: ignore[arg-type]
        before = dump(url, prefix)
        with pytest.raises(Conflict):  # a final response is never overwritten
            await store.conversations.commit_turn("t", cid, f2, r2, [user("new")])
        assert dump(url, prefix) == before
        with pytest.raises(LeaseLost):
            await store.conversations.renew_lease(cid, r1.id, f1)

    run(target, body, lease_ttl_ms=200)


def test_commit_turn_appends_and_sets_last_response(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t", items=[user("hi")])).conversation.id
        r = reply(cid)
        fence = await store.conversations.acquire_lease("t", cid, r.id)
        ctx = await store.conversations.load("t", cid)
        inputs = [user("q")]
        v = await store.conversations.commit_turn(
            "t", cid, fence, r, inputs, base_version=ctx.state.version, prompt_ids=[1, 2, 3], output_ids=[7, 8]
        )
        assert v == ctx.state.version + 1
        # a replay of the same commit (its reply lost) answers as the first did, writing nothing
        assert await store.conversations.commit_turn("t", cid, fence, r, inputs) == v
        ctx = await store.conversations.load("t", cid)
        assert [i.id for i in ctx.items] == [ctx.items[0].id, inputs[0].id, r.output[0].id]
        assert (ctx.last_response_id, ctx.prompt_ids, ctx.output_ids) == (r.id, [1, 2, 3], [7, 8])
        assert await store.responses.get("t", r.id) == r
        assert (await store.responses.list_input_items("t", r.id)).items == inputs
        ttl = await store.client.ttl(store.keys.conv(cid))
        assert 900 < ttl <= 1000
        # a turn whose items changed under it is appended but its tokens are not the prefix
        r2 = reply(cid)
        fence = await store.conversations.acquire_lease("t", cid, r2.id)
        await store.conversations.append_items("t", cid, [user("meanwhile")])
        await store.conversations.commit_turn("t", cid, fence, r2, [user("q2")], base_version=v, prompt_ids=[1])
        assert (await store.conversations.load("t", cid)).last_response_id is None
        # a failed turn: the response is kept, the items are unchanged
        r3 = reply(cid, status="failed")
        fence = await store.conversations.acquire_lease("t", cid, r3.id)
        before = (await store.conversations.get("t", cid)).version
        assert await store.conversations.commit_turn("t", cid, fence, r3, [user("q3")], append=False) == before
        assert (await store.responses.get("t", r3.id)).status == "failed"
        await store.conversations.acquire_lease("t", cid, new_id("resp"))  # released

    run(target, body, state_ttl_s=1000)


def test_concurrent_committers_one_at_a_time_versions_never_go_back(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t")).conversation.id
        other = SessionStore.connect(target[0], store.config)
        busy, seen, done = [0], [], asyncio.Event()

        async def actor(s: SessionStore) -> list[int]:
            versions: list[int] = []
            while len(versions) < 6:
                r = reply(cid)
                try:
                    fence = await s.conversations.acquire_lease("t", cid, r.id)
                except ConversationBusy:
                    busy[0] += 1
                    await asyncio.sleep(0.001)
                    continue
                ctx = await s.conversations.load("t", cid)
                await asyncio.sleep(0.002)  # generating: the other actor tries meanwhile
                v = await s.conversations.commit_turn("t", cid, fence, r, [user("q")], base_version=ctx.state.version)
                assert v == ctx.state.version + 1
                versions.append(v)
            return versions

        async def watch() -> None:
            while not done.is_set():
                seen.append((await store.conversations.get("t", cid)).version)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        a, b = await asyncio.gather(actor(store), actor(other))
        done.set()
        await watcher
        await other.close()
        assert a == sorted(a) and b == sorted(b) and sorted(a + b) == list(range(1, 13))
        assert seen == sorted(seen) and busy[0] > 0
        assert len((await store.conversations.load("t", cid)).items) == 24

    run(target, body)


def test_other_tenants_get_not_found(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        c = store.conversations
        cid = (await c.create("a", items=[user("secret")])).conversation.id
        item = (await c.list_items("a", cid)).items[0]
        r = reply(None)
        await store.responses.save("a", r, [user("q")])
        calls: list[Awaitable[Any]] = [
            c.get("b", cid),
            c.load("b", cid),
            c.list_items("b", cid),
            c.get_item("b", cid, item.id),
            c.append_items("b", cid, [user("x")]),
            c.delete_item("b", cid, item.id),
            c.update("b", cid, {"x": "y"}),
            c.acquire_lease("b", cid, new_id("resp")),
            c.delete("b", cid),
            store.responses.get("b", r.id),
            store.responses.list_input_items("b", r.id),
            store.responses.load_chain("b", r.id),
            store.responses.save("b", r),
            store.responses.delete("b", r.id),
            store.events.read("b", r.id),
        ]
        for call in calls:
            with pytest.raises(NotFound):
                await call
        assert (await c.list_items("a", cid)).items == [item] and await store.responses.get("a", r.id) == r

    run(target, body)


def test_chain_walk(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        responses: list[Response] = []
        inputs: list[list[Item]] = []
        prev: str | None = None
        for i in range(3):
            r, inp = reply(None, f"answer {i}", previous_response_id=prev), [user(f"question {i}")]
            await store.responses.save("t", r, inp, prompt_ids=list(range(4 * i + 2)), output_ids=[100 + i])
            responses, inputs, prev = [*responses, r], [*inputs, inp], r.id
        assert prev is not None
        chain = await store.responses.load_chain("t", prev)
        assert [link.response for link in chain.links] == responses
        assert [link.input_items for link in chain.links] == inputs
        assert (chain.prompt_ids, chain.output_ids) == (list(range(10)), [102])
        assert len((await store.responses.load_chain("t", responses[0].id)).links) == 1
        await store.responses.delete("t", responses[1].id)
        with pytest.raises(NotFound) as missing:
            await store.responses.load_chain("t", prev)
        assert missing.value.id == responses[1].id

    async def short(store: SessionStore) -> None:
        prev = ""
        for _ in range(3):
            r = reply(None, previous_response_id=prev or None)
            await store.responses.save("t", r)
            prev = r.id
        with pytest.raises(ChainTooLong):
            await store.responses.load_chain("t", prev)

    run(target, body)
    run(target, short, max_chain=2)


def test_final_responses_and_idempotency(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        r, inputs = reply(None, status="in_progress"), [user("q")]
        await store.responses.save("t", r, inputs)
        done = msgspec.structs.replace(r, status="completed")
        await store.responses.save("t", done)
        await store.responses.save("t", done)  # the same final write again: a replay
        with pytest.raises(Conflict):
            await store.responses.save("t", msgspec.structs.replace(r, status="cancelled"))
        assert await store.responses.get("t", r.id) == done
        assert (await store.responses.list_input_items("t", r.id)).items == inputs
        assert await store.remember_idempotency("t", "key-1", "resp_a") is None
        assert await store.remember_idempotency("t", "key-1", "resp_b") == "resp_a"
        assert await store.remember_idempotency("t", "key-1", "resp_a") is None
        assert await store.remember_idempotency("u", "key-1", "resp_c") is None
        assert 86_000 < await store.client.ttl(store.keys.idem("t", "key-1")) <= 86_400
        await store.forget_idempotency("t", "key-1", "resp_b")  # not bound to resp_b: kept
        assert await store.remember_idempotency("t", "key-1", "resp_d") == "resp_a"
        await store.forget_idempotency("t", "key-1", "resp_a")
        assert await store.remember_idempotency("t", "key-1", "resp_d") is None
        secret = await store.compaction_secret()
        assert len(secret) == 32 and await SessionStore(store.client, store.config).compaction_secret() == secret

    run(target, body)
