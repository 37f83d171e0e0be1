"""Image parts in the session store against a real Redis (`sessions.image_store`): a data-URL
image is stored once per conversation however often it is sent, items point at it and read back
byte-identical (items, one item, a turn's context, a response's input items, a chain); deleting
items, the conversation and its responses deletes the images nothing points at any more; saving a
response again counts nothing twice; an http(s) part whose bytes were fetched is stored the same
way, its URL whole, and reads back as sent with its bytes on the part for rendering; parts that
are neither (a URL never fetched, a data URL that is not canonical base64) stay inline; items
written before (image inline) still read."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import msgspec
import pytest

from sessions.ids import new_id
from sessions.image_store import data_url_bytes
from sessions.items import InputImage, Item, Message, parse_item
from sessions.store import SessionStore, StoreConfig
from tests.redis_server import shared_redis
from tests.test_session_store import reply

T = TypeVar("T")
PIC_A = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40  # 10 KB; the store does not read images
PIC_B = b"GIF89a" + bytes(reversed(range(256))) * 40


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def with_image(image_url: str, text: str = "What is this?") -> Item:
    content = [{"type": "input_image", "image_url": image_url, "detail": "low"}, {"type": "input_text", "text": text}]
    return parse_item({"role": "user", "content": content})


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


def run(target: tuple[str, str], body: Callable[[SessionStore], Awaitable[T]]) -> T:
    async def main() -> T:
        store = SessionStore.connect(target[0], StoreConfig(prefix=target[1], state_ttl_s=1000))
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


async def image_keys(store: SessionStore, any_id: str) -> dict[str, int]:
    """sha256 -> refs of every image key in `any_id`'s slot tag."""
    out: dict[str, int] = {}
    async for key in store.client.scan_iter(match=store.keys.image(any_id, "*"), count=1000):
        out[key.decode().rsplit(":", 1)[1]] = int(await store.client.hget(key, "refs") or 0)  # type: ignore[misc]
    return out


async def turn(store: SessionStore, cid: str, inputs: list[Item]) -> str:
    r = reply(cid, id=new_id("resp", like=cid))
    fence = await store.conversations.acquire_lease("t", cid, r.id)
    await store.conversations.commit_turn("t", cid, fence, r, inputs)
    return r.id


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_same_image_in_three_turns_is_stored_once_and_reads_back_as_sent(target: tuple[str, str]) -> None:
    sent = url(PIC_A)

    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t")).conversation.id
        inputs = [[with_image(sent, f"turn {i}")] for i in range(3)]
        resps = [await turn(store, cid, x) for x in inputs]
        # one key, pointed at by the 3 conversation items and the 3 responses' input items
        assert await image_keys(store, cid) == {sha(PIC_A): 6}
        stored = await store.client.hvals(store.keys.items(cid))  # type: ignore[misc]
        assert sum(len(v) for v in stored) < len(PIC_A)  # no copy of the bytes in the items
        assert all(base64.b64encode(PIC_A)[:64] not in v for v in stored)
        ttl = await store.client.ttl(store.keys.image(cid, sha(PIC_A)))
        assert 900 < ttl <= 1000
        # every read gives the part back byte-identical
        items = (await store.conversations.list_items("t", cid, order="asc")).items
        assert [i for i in items if i.id in {x[0].id for x in inputs}] == [x[0] for x in inputs]
        assert msgspec.json.decode(msgspec.json.encode(items[0]))["content"][0] == {
            "type": "input_image",
            "image_url": sent,
            "detail": "low",
        }
        assert await store.conversations.get_item("t", cid, inputs[1][0].id) == inputs[1][0]
        assert (await store.conversations.load("t", cid)).items == items
        assert (await store.responses.list_input_items("t", resps[2])).items == inputs[2]

    run(target, body)


def test_two_images_twice_each_are_two_keys_deleted_with_their_last_reference(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        a, b = [with_image(url(PIC_A)), with_image(url(PIC_A))], [with_image(url(PIC_B, "image/gif"))]
        cid = (await store.conversations.create("t", items=a)).conversation.id
        await store.conversations.append_items("t", cid, b)
        await store.conversations.append_items("t", cid, b)  # a replay: counts nothing again
        both = parse_item({"role": "user", "content": [*a[0].content, *b[0].content]})  # type: ignore[union-attr]
        await store.conversations.append_items("t", cid, [both])
        assert await image_keys(store, cid) == {sha(PIC_A): 3, sha(PIC_B): 2}
        for item in [*a, b[0]]:
            await store.conversations.delete_item("t", cid, item.id)
        assert await image_keys(store, cid) == {sha(PIC_A): 1, sha(PIC_B): 1}
        assert (await store.conversations.list_items("t", cid)).items == [both]
        await store.conversations.delete_item("t", cid, both.id)
        assert await image_keys(store, cid) == {}
        assert not await store.client.exists(store.keys.images(cid))

    run(target, body)


def test_deleting_the_conversation_and_its_responses_deletes_their_images(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t", items=[with_image(url(PIC_B))])).conversation.id
        resp = await turn(store, cid, [with_image(url(PIC_A))])
        await store.conversations.delete("t", cid)
        # the response's input items still point at its image (GET input_items reads it)
        assert await image_keys(store, cid) == {sha(PIC_A): 1}
        assert (await store.responses.list_input_items("t", resp)).items[0].content[0].image_url == url(PIC_A)  # type: ignore[union-attr]
        await store.responses.delete("t", resp)
        assert await image_keys(store, cid) == {}

    run(target, body)


def test_a_response_in_another_slot_keeps_its_own_copy(target: tuple[str, str]) -> None:
    """A response id from before hash tags does not share its conversation's tag: its input items'
    images go to its own slot."""

    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t")).conversation.id
        r = reply(cid)
        fence = await store.conversations.acquire_lease("t", cid, r.id)
        inputs = [with_image(url(PIC_A))]
        await store.conversations.commit_turn("t", cid, fence, r, inputs)
        assert await image_keys(store, cid) == {sha(PIC_A): 1} == await image_keys(store, r.id)
        assert (await store.responses.list_input_items("t", r.id)).items == inputs
        assert (await store.conversations.load("t", cid)).items[0] == inputs[0]
        await store.responses.delete("t", r.id)
        await store.conversations.delete("t", cid)
        assert await image_keys(store, cid) == {} == await image_keys(store, r.id)

    run(target, body)


def test_a_response_saved_again_and_a_chain(target: tuple[str, str]) -> None:
    async def body(store: SessionStore) -> None:
        first = reply(None, status="in_progress")
        inputs = [with_image(url(PIC_A))]
        await store.responses.save("t", first, inputs)
        first.status = "completed"
        await store.responses.save("t", first, inputs)  # the running snapshot, then the final record
        assert await image_keys(store, first.id) == {sha(PIC_A): 1}
        second = reply(None, id=new_id("resp", like=first.id), previous_response_id=first.id)
        await store.responses.save("t", second, [with_image(url(PIC_A)), with_image(url(PIC_B))])
        assert await image_keys(store, first.id) == {sha(PIC_A): 2, sha(PIC_B): 1}
        chain = await store.responses.load_chain("t", second.id)
        assert chain.links[0].input_items == inputs and len(chain.links[1].input_items) == 2
        await store.responses.delete("t", first.id)
        assert await image_keys(store, first.id) == {sha(PIC_A): 1, sha(PIC_B): 1}
        await store.responses.delete("t", second.id)
        assert await image_keys(store, first.id) == {}

    run(target, body)


def fetched(image_url: str, data: bytes, text: str = "What is this?") -> Item:
    """An item whose http(s) image part was fetched (as `ImageParts.check_items` leaves it)."""
    item = with_image(image_url, text)
    part(item).keep_fetched(data)
    return item


def part(item: Item) -> InputImage:
    """The first part of a message, an image."""
    assert isinstance(item, Message)
    first = item.content[0]
    assert isinstance(first, InputImage)
    return first


def test_a_fetched_url_part_is_stored_by_reference_and_reads_back_as_sent(target: tuple[str, str]) -> None:
    sent = "https://example.com/cat.gif"

    async def body(store: SessionStore) -> None:
        first, again = fetched(sent, PIC_B), fetched(sent, PIC_B, "again")
        cid = (await store.conversations.create("t", items=[first])).conversation.id
        # the same bytes sent as a data URL are the same key
        resp = await turn(store, cid, [again, with_image(url(PIC_B, "image/gif"))])
        assert await image_keys(store, cid) == {sha(PIC_B): 5}  # 3 conversation items, 2 input items
        raw = await store.client.hget(store.keys.items(cid), first.id)  # type: ignore[misc]
        assert isinstance(raw, bytes) and base64.b64encode(PIC_B)[:64] not in raw
        assert msgspec.json.decode(raw)["content"][0] == {
            "type": "input_image",
            "image_url": sent,
            "image_ref": sha(PIC_B),
            "detail": "low",
        }
        items = (await store.conversations.list_items("t", cid, order="asc")).items
        assert items[:2] == [first, again] and part(items[0]).fetched == PIC_B == part(items[1]).fetched
        assert msgspec.json.decode(msgspec.json.encode(items[0]))["content"][0] == {
            "type": "input_image",
            "image_url": sent,
            "detail": "low",
        }
        assert part(await store.conversations.get_item("t", cid, again.id)).fetched == PIC_B
        assert part((await store.conversations.load("t", cid)).items[0]).fetched == PIC_B  # what a turn renders
        inputs = (await store.responses.list_input_items("t", resp, order="asc")).items
        assert inputs[0] == again and part(inputs[0]).fetched == PIC_B
        await store.conversations.delete_item("t", cid, first.id)
        assert await image_keys(store, cid) == {sha(PIC_B): 4}
        await store.conversations.delete("t", cid)
        assert await image_keys(store, cid) == {sha(PIC_B): 2}
        await store.responses.delete("t", resp)
        assert await image_keys(store, cid) == {}
        # a `previous_response_id` chain renders from the stored bytes as well
        alone = reply(None)
        await store.responses.save("t", alone, [fetched(sent, PIC_A)])
        chain = await store.responses.load_chain("t", alone.id)
        assert part(chain.links[0].input_items[0]).fetched == PIC_A
        await store.responses.delete("t", alone.id)
        assert await image_keys(store, alone.id) == {}

    run(target, body)


def test_other_parts_stay_inline_and_items_from_before_still_read(target: tuple[str, str]) -> None:
    padded = url(PIC_A)[:-4] + "AB=="  # decodes, but is not the canonical base64 of its bytes
    assert data_url_bytes(padded) is None and data_url_bytes(url(PIC_A)) is not None
    inline = [with_image(padded), with_image("https://example.com/cat.png"), with_image("data:image/png,raw")]

    async def body(store: SessionStore) -> None:
        cid = (await store.conversations.create("t", items=inline)).conversation.id
        assert await image_keys(store, cid) == {}
        assert (await store.conversations.list_items("t", cid, order="asc")).items == inline
        # an item as the layout before wrote it: the whole data URL inside the item's JSON
        old = Message(id=new_id("msg"), role="user", content=[InputImage(image_url=url(PIC_B))])
        raw = msgspec.json.encode(old)
        await store.client.hset(store.keys.items(cid), old.id, raw)  # type: ignore[misc]
        await store.client.zadd(store.keys.order(cid), {old.id: 99})
        ctx = await store.conversations.load("t", cid)
        assert ctx.items == [*inline, old] and await store.conversations.get_item("t", cid, old.id) == old
        await store.conversations.delete_item("t", cid, old.id)
        await store.conversations.delete("t", cid)

    run(target, body)
