"""`RequestHandle` delivery: `push_all` hands a step's outputs to their consumers, waking each
asyncio loop once for all of its consumers; a consumer whose loop has closed is reported so the
caller can abort it, and its later outputs still queue."""

from __future__ import annotations

import asyncio
import threading

from engine.request import FinishReason, RequestHandle, RequestOutput, push_all


def _out(rid: str, text: str, final: bool = False) -> RequestOutput:
    return RequestOutput(rid, [1], text, None, FinishReason.STOP if final else None, 3, 1)


def test_push_all_wakes_each_loop_once_per_step() -> None:
    aborted: list[str] = []
    handles = [RequestHandle(f"r{i}", aborted.append) for i in range(16)]
    got: dict[str, list[str]] = {h.id: [] for h in handles}
    wakes = [0]
    subscribed = threading.Event()
    loop = asyncio.new_event_loop()
    real = loop.call_soon_threadsafe

    def counting(*args: object, **kwargs: object) -> object:
        wakes[0] += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]

    async def consume(h: RequestHandle) -> None:
        async for out in h:
            got[h.id].append(out.text_delta)

    async def main() -> None:
        tasks = [asyncio.create_task(consume(h)) for h in handles]
        await asyncio.sleep(0)  # every consumer is waiting on its event
        subscribed.set()
        await asyncio.gather(*tasks)

    steps = 5

    def engine() -> None:
        subscribed.wait(10)
        for step in range(steps):
            gone = push_all([(h, _out(h.id, f"t{step}", step == steps - 1)) for h in handles])
            assert gone == []

    t = threading.Thread(target=engine)
    t.start()
    loop.run_until_complete(asyncio.wait_for(main(), 30))
    t.join(10)
    loop.close()
    assert all(texts == [f"t{s}" for s in range(steps)] for texts in got.values())
    assert wakes[0] == steps  # one per step, not one per handle
    assert aborted == []


def test_a_closed_loops_consumers_are_reported_gone() -> None:
    live, dead = RequestHandle("live", lambda rid: None), RequestHandle("dead", lambda rid: None)
    closed = asyncio.new_event_loop()

    async def subscribe() -> None:
        it = dead.__aiter__()
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)
        task.cancel()

    closed.run_until_complete(subscribe())
    # the cancelled consumer left early: it detached itself; attach it again as a consumer whose loop then closes
    dead._loop, dead._event = closed, asyncio.Event()
    closed.close()
    gone = push_all([(live, _out("live", "a")), (dead, _out("dead", "a"))])
    assert gone == [dead] and not dead.done
    assert push_all([(dead, _out("dead", "b", final=True))]) == []  # detached: later outputs only queue
    assert [o.text_delta for o in dead] == ["a", "b"]
    assert [o.text_delta for o in [live._queue.get_nowait()]] == ["a"]
