"""The state and the KV tier on a real 3-master Redis Cluster on loopback (`tests.redis_cluster`):
the store's scripts (each on one slot), and a server whose `--redis-url` / `--kv-redis-url` name
one node of a cluster, driven by the `openai` client through conversation and
`previous_response_id` turns whose prompts stay cached, KV pages spread over every master, and a
KV node killed under it (lookups recompute, no request fails)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import redis.cluster

from kvstore.redis_connect import cluster_enabled, connect
from sessions.ids import new_id, slot_tag
from sessions.items import Item, Message, OutputText, parse_item
from sessions.models import ConversationRef, Response
from sessions.store import SessionStore
from tests.cores import THREADS_ARG
from tests.redis_cluster import LocalCluster, local_cluster
from tests.redis_server import shared_redis, unique_prefix
from tests.server import TEST_KEY, keys_args, start_server

ARGS = ("--dtype", "float32", "--threads", THREADS_ARG, "--kv-cache-bytes", "64MiB", "--background-workers", "1",
        "--served-model-name", "demo")  # fmt: skip
NOTES = " ".join(f"Note {i}: the hive number {i} gave {i % 7 + 3} kilos of honey." for i in range(12))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with local_cluster(3) as c:
        yield c


def test_detection(cluster: LocalCluster) -> None:
    assert cluster_enabled(cluster.url)
    with shared_redis() as (single, _):
        assert not cluster_enabled(single)
    assert isinstance(connect(cluster.url), redis.cluster.RedisCluster)


def _user(text: str) -> Item:
    return parse_item({"role": "user", "content": text})


def _with_image(text: str) -> Item:  # its bytes go to the slot's image key (`sessions.image_store`)
    picture = "data:image/png;base64," + base64.b64encode(text.encode() * 100).decode()
    return parse_item({"role": "user", "content": [{"type": "input_image", "image_url": picture}]})


def _reply(text: str, **kw: object) -> Response:
    out = [Message(id=new_id("msg"), role="assistant", content=[OutputText(text=text)])]
    return Response(**{"model": "m", "status": "completed", "output": out, **kw})  # type: ignore[arg-type]


def test_store_scripts_each_run_on_one_slot(cluster: LocalCluster) -> None:
    async def body() -> None:
        from sessions.config import StoreConfig
        from sessions.errors import ConversationBusy

        store = SessionStore.connect(cluster.url, StoreConfig(prefix=unique_prefix()))
        try:
            await store.check_server()
            conv = (await store.conversations.create("t", items=[_user("hello"), _with_image("a")])).conversation
            r1 = _reply("one", id=new_id("resp", like=conv.id), conversation=ConversationRef(conv.id))
            fence = await store.conversations.acquire_lease("t", conv.id, r1.id)
            with pytest.raises(ConversationBusy):
                await store.conversations.acquire_lease("t", conv.id, new_id("resp", like=conv.id))
            ctx = await store.conversations.load("t", conv.id)
            q = [_user("q"), _with_image("a")]
            v = await store.conversations.commit_turn(
                "t", conv.id, fence, r1, q, base_version=ctx.state.version, prompt_ids=[1, 2], output_ids=[3]
            )
            ctx = await store.conversations.load("t", conv.id)
            assert ctx.state.version == v and ctx.last_response_id == r1.id and ctx.prompt_ids == [1, 2]
            assert [i.id for i in ctx.items][-1] == r1.output[0].id
            assert ctx.items[1].content == ctx.items[3].content == _with_image("a").content  # type: ignore[union-attr]
            assert (await store.responses.list_input_items("t", r1.id, order="asc")).items == q
            # a chain: every link takes its previous response's slot tag
            prev = None
            for i in range(4):
                r = _reply(f"a{i}", id=new_id("resp", like=prev), previous_response_id=prev)
                await store.responses.save("t", r, [_with_image(f"q{i % 2}")], prompt_ids=[i], output_ids=[i + 1])
                prev = r.id
            assert prev is not None
            chain = await store.responses.load_chain("t", prev)
            assert [link.response.output[0].content[0].text for link in chain.links] == ["a0", "a1", "a2", "a3"]  # type: ignore[union-attr]
            assert chain.prompt_ids == [3] and len({slot_tag(link.response.id) for link in chain.links}) == 1
            last, before = chain.links[3].input_items[0], chain.links[2].input_items[0]
            assert last.content == _with_image("q1").content != before.content  # type: ignore[union-attr]
            await store.events.append(prev, {"type": "x", "sequence_number": 0})
            assert [e.seq for e in await store.events.read("t", prev)] == [0]
            job = await store.jobs.enqueue(prev, "t")
            assert [j.id for j in await store.jobs.claim("w")] == [job]
            assert await store.jobs.heartbeat("w", job)
            await store.jobs.ack(job)
            await store.responses.delete("t", prev)
            await store.conversations.delete("t", conv.id)
        finally:
            await store.close()

    asyncio.run(body())


def _masters_holding(cluster: LocalCluster, match: str) -> int:
    held = 0
    for port in cluster.ports:
        r = redis.Redis(port=port)
        held += next(iter(r.scan_iter(match=match, count=1000)), None) is not None
    return held


def test_server_on_a_cluster_keeps_turns_cached_and_survives_a_kv_node(
    cluster: LocalCluster, demo_gguf: Path, tmp_path: Path
) -> None:
    with local_cluster(3, full_coverage=False) as kv:
        prefix = unique_prefix()
        args = ("--redis-url", cluster.url, "--kv-redis-url", kv.url, *ARGS, *keys_args(tmp_path))
        server = start_server(demo_gguf, *args, log=tmp_path / "a.log", prefix=prefix)
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)
            conv = client.conversations.create(items=[])
            cached = []
            for i, q in enumerate([NOTES + " Which hive gave most?", "And the least?", "Sum them."]):
                r = client.responses.create(model="demo", conversation=conv.id, input=q, temperature=0,
                                            max_output_tokens=8)  # fmt: skip
                assert r.status in ("completed", "incomplete") and r.usage is not None, server.log_tail()
                if i:
                    cached.append(r.usage.input_tokens_details.cached_tokens / r.usage.input_tokens)
            assert min(cached) >= 0.8, cached
            prev = None
            for q in ["Name a colour.", "Another one.", "And a third."]:
                r = client.responses.create(model="demo", input=q, previous_response_id=prev, temperature=0,
                                            max_output_tokens=6)  # fmt: skip
                assert r.status in ("completed", "incomplete"), server.log_tail()
                if prev is not None:
                    assert slot_tag(r.id) == slot_tag(prev)
                prev = r.id
            items = client.conversations.items.list(conv.id, order="asc")
            assert len(items.data) == 6
            assert _masters_holding(cluster, f"{prefix}:{{*}}:conv:*") >= 1
            assert _masters_holding(kv, f"{prefix}:kv:*") == 3  # pages spread over every master
            kv.kill(kv.ports[1])
            r = client.responses.create(model="demo", conversation=conv.id, input="Once more.", temperature=0,
                                        max_output_tokens=4)  # fmt: skip
            assert r.status in ("completed", "incomplete"), server.log_tail()
        finally:
            server.stop()
