"""Background responses on the demo model and a real Redis: `background: true` answers `queued`, a
worker runs it and its events are read back from the store (and resumed after N); a job whose
worker died is taken over and rerun, its new events saying `"attempt": 2`; cancel acts wherever
the response runs; a foreground response cannot be cancelled."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from engine.engine import Engine
from sessions.config import WorkerConfig
from sessions.items import Message, text_of
from sessions.requests import InvalidParam
from sessions.service import SessionService
from sessions.tasks import BackgroundWorkers
from tests.session_engine import TENANT, Run, collect, compiler, engine, run, target, whole

__all__ = ["compiler", "engine", "run", "target"]  # fixtures
QUESTION = {"input": "What is the capital of France?", "temperature": 0, "max_output_tokens": 24}
LONG = {"input": "Tell me a long story about a dragon.", "temperature": 0, "max_output_tokens": 400}


async def with_workers(svc: SessionService, body: Any, **kw: Any) -> Any:
    workers = asyncio.create_task(BackgroundWorkers(svc, WorkerConfig(workers=1, **kw)).run())
    try:
        return await body
    finally:
        workers.cancel()
        await asyncio.gather(workers, return_exceptions=True)
        assert isinstance(svc.engine, Engine)
        for _ in range(500):  # aborted requests end on the engine thread: before this loop closes
            if not svc.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)


def test_background_response_runs_and_streams_from_the_store(run: Run) -> None:
    async def body(svc: SessionService) -> None:
        queued = await whole(svc.create(TENANT, {**QUESTION, "background": True}))
        assert queued.status == "queued" and queued.background
        running: list[str] = []  # its status as retrieved when its first text arrived

        async def read() -> list[dict[str, Any]]:
            events = []
            async for event in svc.stream_events(TENANT, queued.id):
                if event["type"] == "response.output_text.delta" and not running:
                    running.append((await svc.retrieve(TENANT, queued.id)).status)
                events.append(event)
            return events

        events = await with_workers(svc, read())
        assert running == ["in_progress"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
        done = await svc.retrieve(TENANT, queued.id)
        assert done.status == "completed" and "Paris" in text_of(done.output[0])
        resumed = await collect(svc.stream_events(TENANT, queued.id, starting_after=2))
        assert resumed == events[3:]
        assert "attempt" not in events[0]

        foreground = await whole(svc.create(TENANT, QUESTION))
        with pytest.raises(InvalidParam):
            await svc.cancel(TENANT, foreground.id)

    run(body)


def test_a_dead_workers_job_is_rerun_as_attempt_2(run: Run) -> None:
    async def body(svc: SessionService) -> None:
        queued = await whole(svc.create(TENANT, {**QUESTION, "background": True}))
        (job,) = await svc.store.jobs.claim("dead-worker")  # claimed, then its server died mid-way
        for seq in range(2):
            await svc.store.events.append(queued.id, {"type": "response.created", "sequence_number": seq})
        start = time.monotonic()
        events = await with_workers(
            svc, collect(svc.stream_events(TENANT, queued.id)), heartbeat_s=0.2, claim_idle_s=1.0
        )
        assert time.monotonic() - start < 30 and job.response_id == queued.id
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert all(e.get("attempt") == 2 for e in events[2:]) and events[-1]["type"] == "response.completed"
        assert (await svc.retrieve(TENANT, queued.id)).status == "completed"

    run(body)


@pytest.mark.parametrize("where", ["here", "elsewhere"])
def test_cancel_acts_within_seconds(run: Run, where: str) -> None:
    async def body(svc: SessionService) -> None:
        conv = (await svc.conversations.create(TENANT)).id
        queued = await whole(svc.create(TENANT, {**LONG, "conversation": conv, "background": True}))

        async def cancel_once_generating() -> tuple[Any, float, list[Any]]:
            async for event in svc.stream_events(TENANT, queued.id):
                if event["type"] == "response.output_text.delta":
                    break
            # "elsewhere": a server that does not run it (a second service on the same store)
            other = svc if where == "here" else SessionService(
                svc.engine, svc.store, svc.tokenizer, svc.compiler, svc.tool_format
            )  # fmt: skip
            start = time.monotonic()
            answer = await other.cancel(TENANT, queued.id)
            events = await collect(svc.stream_events(TENANT, queued.id))
            return answer, time.monotonic() - start, events

        answer, took, events = await with_workers(svc, cancel_once_generating())
        assert answer.status == "cancelled" and took < 10
        assert events[-1]["type"] == "response.cancelled"
        assert (await svc.retrieve(TENANT, queued.id)).status == "cancelled"
        state = await svc.store.conversations.load(TENANT, conv)
        assert state.items == [] and state.state.version == 0  # a cancelled turn appends nothing
        r = await whole(svc.create(TENANT, {**QUESTION, "conversation": conv}))  # the lease was released
        assert r.status == "completed" and isinstance(r.output[0], Message)

    run(body)


def test_cancel_while_queued_never_runs(run: Run) -> None:
    async def body(svc: SessionService) -> None:
        queued = await whole(svc.create(TENANT, {**QUESTION, "background": True}))
        assert (await svc.cancel(TENANT, queued.id)).status == "cancelled"
        assert isinstance(svc.engine, Engine)
        computed = svc.engine.stats.prompt_tokens_computed

        async def drained() -> None:  # its job was claimed and acked
            ours = queued.id.encode()
            while True:
                jobs = cast(list[tuple[bytes, dict[bytes, bytes]]], await svc.store.client.xrange(svc.store.keys.jobs))
                if not any(f[b"resp"] == ours for _, f in jobs):
                    return
                await asyncio.sleep(0.05)

        await with_workers(svc, asyncio.wait_for(drained(), 10))
        assert (await svc.retrieve(TENANT, queued.id)).status == "cancelled"
        assert svc.engine.stats.prompt_tokens_computed == computed  # never reached the engine
        assert await svc.store.events.read(TENANT, queued.id) == []

    run(body)
