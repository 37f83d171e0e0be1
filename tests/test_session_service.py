"""The session service on the demo model (float32, greedy) and a real Redis, driven directly with
asyncio: three turns via `conversation` and via `previous_response_id` reuse the KV of the turn
before (cached tokens, prefill counted by the engine) and equal the same history sent whole with
`store: false`; stream events in order; a tool round trip; bad backfill and a busy conversation
change nothing; a dropped stream ends `incomplete`, committed once; Idempotency-Key repeats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest
import redis

from engine.engine import Engine
from sessions.config import ServiceConfig
from sessions.errors import ConversationBusy, RequestInProgress
from sessions.event_stream import EventStream
from sessions.items import FunctionCall, Message, text_of
from sessions.models import Response
from sessions.requests import InvalidParam
from sessions.service import SessionService
from sessions.store import SessionStore, StoreConfig
from tests.session_engine import PAGE, TENANT, Run, collect, compiler, engine, run, streamed, target, whole
from tools.formats import detect_format
from tools.grammar import GrammarCompiler

__all__ = ["compiler", "engine", "run", "target"]  # fixtures

QUESTIONS = ["What is the capital of France?", "And of Germany?", "And of Italy?"]
GREEDY = {"temperature": 0, "max_output_tokens": 24}
WEATHER = {
    "type": "function", "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}  # fmt: skip


def dump(target: tuple[str, str]) -> dict[bytes, Any]:
    """Our keys and contents, but the fence counter (every lease takes a number; it only grows) and
    the token cache (`sessions.token_cache`: ids of finished turns, expiring, stored state of none)."""
    r = redis.Redis.from_url(target[0])

    def fields(k: bytes) -> dict[bytes, bytes]:  # a conversation's fence counter is a field of its hash
        got: dict[bytes, bytes] = r.hgetall(k)  # type: ignore[assignment]  # bytes: no decode_responses
        return {f: v for f, v in got.items() if f != b"fence"}

    read = {b"string": r.get, b"hash": fields, b"zset": lambda k: r.zrange(k, 0, -1, withscores=True)}
    keys: list[bytes] = [k for k in r.scan_iter(match=f"{target[1]}*")
            if r.type(k) in read and b":tok:" not in k and not k.endswith(b":layout")]  # fmt: skip
    return {k: read[cast(bytes, r.type(k))](k) for k in keys}


def answer(r: Response) -> str:
    return "".join(text_of(i) for i in r.output if isinstance(i, Message))


def check_reuse(engine: Engine, turns: Callable[[int, Response | None], Awaitable[Response]]) -> Callable[..., Any]:
    async def body(_: SessionService) -> list[Response]:
        out: list[Response] = []
        for n in range(len(QUESTIONS)):
            before = engine.stats.prompt_tokens_computed
            r = await turns(n, out[-1] if out else None)
            assert r.status == "completed" and r.usage is not None, r
            computed = engine.stats.prompt_tokens_computed - before
            cached = r.usage.input_tokens_details.cached_tokens
            if out:
                prev = out[-1].usage
                assert prev is not None
                assert cached >= (prev.input_tokens + prev.output_tokens) // PAGE * PAGE
                assert computed <= r.usage.input_tokens - cached + PAGE
            out.append(r)
        return out

    return body


def whole_history(run: Run, responses: list[Response]) -> None:
    """Each turn sent again as its whole history with store: false gives the same prompt and text."""

    async def body(svc: SessionService) -> None:
        history: list[Any] = []
        for q, r in zip(QUESTIONS, responses, strict=True):
            history.append({"role": "user", "content": q})
            again = await whole(svc.create(TENANT, {"input": history, "store": False, **GREEDY}))
            assert again.usage.input_tokens == r.usage.input_tokens  # type: ignore[union-attr]
            assert answer(again) == answer(r)
            history += [{"role": "assistant", "content": answer(r)}]

    run(body)


def test_three_turns_in_a_conversation(run: Run, engine: Engine, target: tuple[str, str]) -> None:
    conv_id = run(lambda svc: svc.store.conversations.create(TENANT)).conversation.id

    async def turn(n: int, _: Response | None) -> Response:
        return await whole(svc_of[0].create(TENANT, {"conversation": conv_id, "input": QUESTIONS[n], **GREEDY}))

    svc_of: list[SessionService] = []

    async def body(svc: SessionService) -> list[Response]:
        svc_of.append(svc)
        out: list[Response] = await check_reuse(engine, turn)(svc)
        items = (await svc.store.conversations.load(TENANT, conv_id)).items
        assert len(items) == 6 and [answer(r) for r in out] == [text_of(i) for i in items[1::2]]
        return out

    responses = run(body)
    assert "Paris" in answer(responses[0])
    whole_history(run, responses)


def test_three_turns_by_previous_response_id(run: Run, engine: Engine) -> None:
    svc_of: list[SessionService] = []

    async def turn(n: int, prev: Response | None) -> Response:
        body = {"input": QUESTIONS[n], "instructions": None, **GREEDY}
        return await whole(svc_of[0].create(TENANT, body | ({"previous_response_id": prev.id} if prev else {})))

    async def body(svc: SessionService) -> list[Response]:
        svc_of.append(svc)
        out: list[Response] = await check_reuse(engine, turn)(svc)
        assert (await svc.retrieve(TENANT, out[-1].id)).previous_response_id == out[1].id
        return out

    whole_history(run, run(body))


def test_stream_events_in_order(run: Run) -> None:
    async def body(svc: SessionService) -> tuple[list[dict[str, Any]], Response]:
        stream = await streamed(svc.create(TENANT, {"input": QUESTIONS[0], "stream": True, **GREEDY}))
        assert isinstance(stream, EventStream)
        events = await collect(stream)
        return events, await svc.retrieve(TENANT, events[-1]["response"].id)

    events, stored = run(body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-4]["text"]
    assert text == done == answer(events[-1]["response"]) == answer(stored) and text
    assert events[0]["response"].status == "in_progress" and not events[0]["response"].output


def test_tool_round_trip_and_bad_backfill(run: Run, target: tuple[str, str]) -> None:
    tools = {"tools": [WEATHER], "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 40}

    async def body(svc: SessionService) -> None:
        conv = (await svc.store.conversations.create(TENANT)).conversation.id
        stream = await streamed(svc.create(
            TENANT, {"conversation": conv, "input": "What is the weather in Paris?", "tool_choice": "required",
                     "stream": True, **tools},
        ))  # fmt: skip
        events = await collect(stream)
        call = events[-1]["response"].output[-1]
        assert [type(i) for i in events[-1]["response"].output] == [FunctionCall]  # calls only: no message
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert deltas == done["arguments"] == call.arguments and call.name == "get_weather"
        assert "Paris" in call.arguments

        before = dump(target)
        bad = {"type": "function_call_output", "call_id": "call_unknown", "output": "18C"}
        with pytest.raises(InvalidParam) as e:
            await whole(svc.create(TENANT, {"conversation": conv, "input": [bad], **tools}))
        assert e.value.param == "input[0].call_id" and dump(target) == before

        output = {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}
        r = await whole(svc.create(TENANT, {"conversation": conv, "input": [output], **tools}))
        assert r.status == "completed" and answer(r) and not any(isinstance(i, FunctionCall) for i in r.output)
        with pytest.raises(InvalidParam, match="already been answered"):
            await whole(svc.create(TENANT, {"conversation": conv, "input": [output], **tools}))

    run(body)


def test_concurrent_turns_one_busy(run: Run) -> None:
    async def body(svc: SessionService) -> None:
        conv = (await svc.store.conversations.create(TENANT)).conversation.id
        got = await asyncio.gather(
            *(svc.create(TENANT, {"conversation": conv, "input": q, **GREEDY}) for q in QUESTIONS[:2]),
            return_exceptions=True,
        )
        assert sorted(type(g).__name__ for g in got) == ["ConversationBusy", "Response"], got
        state = await svc.store.conversations.load(TENANT, conv)
        assert len(state.items) == 2 and state.state.version == 1

    run(body)


def test_dropped_stream_is_incomplete_and_committed_once(run: Run) -> None:
    async def body(svc: SessionService) -> None:
        conv = (await svc.store.conversations.create(TENANT)).conversation.id
        stream = await streamed(svc.create(
            TENANT, {"conversation": conv, "input": "Tell me a long story.", "stream": True, "temperature": 0,
                     "max_output_tokens": 200},
        ))  # fmt: skip
        async for event in stream:
            if event["type"] == "response.output_text.delta":
                break
        await stream.aclose()
        assert isinstance(stream, EventStream) and stream.task is not None
        final = await stream.task
        assert final.status == "incomplete" and final.incomplete_details.reason == "client_disconnected"
        assert final.usage.output_tokens < 200
        stored = await svc.retrieve(TENANT, final.id)
        assert stored.status == "incomplete" and stored.output == final.output
        state = await svc.store.conversations.load(TENANT, conv)
        assert len(state.items) == 2 and state.state.version == 1
        r = await whole(svc.create(TENANT, {"conversation": conv, "input": "Shorter, please.", **GREEDY}))
        assert r.status == "completed"  # the lease was released

    run(body)


def test_idempotency_key_repeats_the_first_response(run: Run) -> None:
    async def body(svc: SessionService) -> None:
        conv = (await svc.store.conversations.create(TENANT)).conversation.id
        req = {"conversation": conv, "input": "Hi!", **GREEDY}
        stream = await streamed(svc.create(TENANT, req | {"stream": True}, idempotency_key="k1"))
        with pytest.raises(RequestInProgress):
            await whole(svc.create(TENANT, req, idempotency_key="k1"))
        first = (await collect(stream))[-1]["response"]
        again = await whole(svc.create(TENANT, req, idempotency_key="k1"))
        assert again.id == first.id and answer(again) == answer(first)
        replay = await collect(await streamed(svc.create(TENANT, req | {"stream": True}, idempotency_key="k1")))
        assert [e["type"] for e in replay] == ["response.created", "response.completed"]
        state = await svc.store.conversations.load(TENANT, conv)
        assert len(state.items) == 2  # one turn only
        # Two new keys at once: one turn, one ConversationBusy, whose key is forgotten (a retry may run).
        got = await asyncio.gather(
            *(svc.create(TENANT, req, idempotency_key=f"k{i}") for i in (2, 3)), return_exceptions=True
        )
        busy = [i for i, g in zip((2, 3), got, strict=True) if isinstance(g, ConversationBusy)]
        assert len(busy) == 1, got
        retry = await whole(svc.create(TENANT, req, idempotency_key=f"k{busy[0]}"))
        assert retry.status == "completed" and retry.id not in {g.id for g in got if isinstance(g, Response)}
        assert len((await svc.store.conversations.load(TENANT, conv)).items) == 6

    run(body)


def test_output_length_checks_and_store_false(run: Run, target: tuple[str, str]) -> None:
    async def body(svc: SessionService) -> None:
        before = dump(target)
        with pytest.raises(InvalidParam) as e:
            await whole(svc.create(TENANT, {"input": "Hi", "max_output_tokens": svc.config.max_output_tokens + 1}))
        assert e.value.param == "max_output_tokens"
        with pytest.raises(InvalidParam) as e:
            await whole(svc.create(TENANT, {"input": "word " * 5000}))
        assert e.value.code == "context_length_exceeded" and "4096" in e.value.message
        bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
        with pytest.raises(InvalidParam) as e:
            tools = [{"type": "function", "name": "f", "parameters": bad}]
            await whole(svc.create(TENANT, {"input": "Hi", "tools": tools}))
        assert e.value.param == "tools[0].parameters"
        with pytest.raises(InvalidParam) as e:
            fmt = {"format": {"type": "json_schema", "name": "x", "schema": bad}}
            await whole(svc.create(TENANT, {"input": "Hi", "text": fmt}))
        assert e.value.param.startswith("text.format")
        r = await whole(svc.create(TENANT, {"input": "Hi", "store": False, "temperature": 0, "max_output_tokens": 4}))
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
        assert dump(target) == before  # nothing written
        r = await whole(svc.create(TENANT, {"input": "Hi", "store": False, "temperature": 0}))
        # the default output length: what the context and the KV cache leave, under the cap
        assert r.max_output_tokens == min(svc.engine.capacity_tokens - r.usage.input_tokens, 4096)  # type: ignore[union-attr]

    run(body)


def test_lease_renewed_while_generating(engine: Engine, target: tuple[str, str], compiler: GrammarCompiler) -> None:
    """A turn generating for longer than the lease lives still commits: it renews the lease. The
    lease lives a quarter of what the same turn took unstored here, so the turn outlives it on any
    machine."""
    # a schema that forces a long reply: 24 numbers
    numbers = {"type": "array", "items": {"type": "integer"}, "minItems": 24, "maxItems": 24}
    schema = {"type": "object", "properties": {"n": numbers}, "required": ["n"]}
    ask = {"input": "Twenty-four numbers, please.", "text": {"format": {"type": "json_schema", "name": "numbers",
           "schema": schema}}, "temperature": 0, "max_output_tokens": 200}  # fmt: skip

    async def turn(lease_ttl_ms: int, **extra: Any) -> tuple[float, int]:
        """(seconds the turn took, items of its conversation; 0 unstored)."""
        store = SessionStore.connect(target[0], StoreConfig(prefix=target[1], lease_ttl_ms=lease_ttl_ms))
        tok = engine.tokenizer
        assert tok is not None
        config = ServiceConfig(lease_renew_s=lease_ttl_ms / 10_000)
        svc = SessionService(engine, store, tok, compiler, detect_format(tok), config)
        try:
            conv = (await svc.conversations.create(TENANT)).id if not extra else None
            start = time.monotonic()
            r = await whole(svc.create(TENANT, {**ask, **({"conversation": conv} if conv else extra)}))
            took = time.monotonic() - start
            assert r.status == "completed" and r.usage.output_tokens >= 48  # type: ignore[union-attr]
            return took, len((await store.conversations.load(TENANT, conv)).items) if conv else 0
        finally:
            await store.close()

    unstored, _ = asyncio.run(turn(30_000, store=False))
    lease_ms = max(1, int(unstored * 250))
    took, items = asyncio.run(turn(lease_ms))
    assert took * 1000 > 2 * lease_ms  # the turn outlived its lease unrenewed (twice over)
    assert items == 2


class CountingGate:
    """A per-tenant waiting gate (the server's `TenantQueue` contract) that records its use and
    refuses past `limit`."""

    def __init__(self, limit: int):
        self.limit, self.waiting, self.entered = limit, 0, 0

    def enter(self, tenant: str) -> None:
        if self.waiting >= self.limit:
            raise RequestInProgress("the tenant's waiting requests are at the limit")
        self.waiting += 1
        self.entered += 1

    def leave(self, tenant: str) -> None:
        self.waiting -= 1
        assert self.waiting >= 0


def test_foreground_turns_hold_a_waiting_place_until_their_first_output(run: Run, target: tuple[str, str]) -> None:
    """A foreground response takes its tenant's waiting place before anything is written, and gives
    it back on every path: completed, streamed, a client that leaves, refused by the engine."""

    async def body(svc: SessionService) -> None:
        gate = svc.waiting = CountingGate(1)
        try:
            await whole(svc.create(TENANT, {"input": QUESTIONS[0], **GREEDY}))
            stream = await streamed(svc.create(TENANT, {"input": QUESTIONS[1], "stream": True, **GREEDY}))
            assert isinstance(stream, EventStream)
            async for event in stream:
                if event["type"] == "response.output_text.delta":
                    assert gate.waiting == 0  # given back at the first output
                    break
            await stream.aclose()
            assert stream.task is not None
            await stream.task
            assert gate.waiting == 0 and gate.entered == 2
            gate.limit = 0  # the tenant is at its limit: refused before any write
            conv = (await svc.store.conversations.create(TENANT)).conversation.id
            before = dump(target)
            with pytest.raises(RequestInProgress):
                await whole(svc.create(TENANT, {"conversation": conv, "input": QUESTIONS[2], **GREEDY}))
            assert dump(target) == before and gate.waiting == 0
            gate.limit = 1
            with pytest.raises(InvalidParam):  # refused by a check: no place left taken
                await whole(svc.create(TENANT, {"input": QUESTIONS[2], "max_output_tokens": 10**9}))
            assert gate.waiting == 0
        finally:
            svc.waiting = None

    run(body)
