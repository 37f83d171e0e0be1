"""Redis bytes of a conversation whose turns send the same screenshot, and the time to load it.

`--turns` turns, each a user message holding the same PNG (`--kib` KiB of incompressible bytes,
sent as a base64 data URL) and a line of text, committed through the session store (as the
server commits a turn: conversation items, the response with its input items) on a private
`redis-server`. Prints the bytes Redis reports (`MEMORY USAGE`) for the conversation's keys,
its responses' keys and its image keys, and the median time of `conversations.load` (the
next turn's read) over 20 runs. Run it on this checkout, and with `PYTHONPATH` at another
checkout to compare.

    python bench/image_storage.py [--turns 5] [--kib 200]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1]))

from sessions.ids import new_id
from sessions.items import Item, Message, OutputText, parse_item
from sessions.models import ConversationRef, Response
from sessions.store import SessionStore, StoreConfig
from tests.redis_server import private_redis


async def measure(url: str, turns: int, kib: int) -> tuple[int, float]:
    store = SessionStore.connect(url, StoreConfig(prefix="bench"))
    picture = b"\x89PNG\r\n\x1a\n" + os.urandom(kib * 1024)
    image_url = "data:image/png;base64," + base64.b64encode(picture).decode()
    cid = (await store.conversations.create("t")).conversation.id
    for i in range(turns):
        content: list[dict[str, str]] = [
            {"type": "input_image", "image_url": image_url},
            {"type": "input_text", "text": f"Turn {i}?"},
        ]
        out: list[Item] = [Message(id=new_id("msg"), role="assistant", content=[OutputText(text="A cat.")])]
        r = Response(id=new_id("resp", like=cid), model="m", status="completed", output=out,
                     conversation=ConversationRef(cid))  # fmt: skip
        fence = await store.conversations.acquire_lease("t", cid, r.id)
        await store.conversations.commit_turn("t", cid, fence, r, [parse_item({"role": "user", "content": content})])
    used = 0
    async for key in store.client.scan_iter(match="bench:{*", count=1000):
        used += int(await store.client.memory_usage(key) or 0)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        await store.conversations.load("t", cid)
        times.append(time.perf_counter() - start)
    await store.close()
    return used, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--kib", type=int, default=200)
    args = ap.parse_args()
    with private_redis() as url:
        used, load_s = asyncio.run(measure(url, args.turns, args.kib))
    print(f"| {args.turns} | {args.kib} | {used / 1024:,.0f} | {load_s * 1000:.2f} |")


if __name__ == "__main__":
    main()
