"""The demo model's engine (float32, greedy), a real Redis under a unique prefix and a fresh
`SessionService` per test, shared by the session service and background-task tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from engine.engine import Engine, EngineConfig
from engine.loading.loader import LoadedModel
from sessions.event_stream import ResponseEvents
from sessions.models import Response
from sessions.service import SessionService
from sessions.store import SessionStore, StoreConfig
from tests.cores import THREADS
from tests.redis_server import shared_redis
from tools.formats import detect_format
from tools.grammar import GrammarCompiler, XGrammarHook

T = TypeVar("T")
TENANT = "t1"
PAGE = 16


@pytest.fixture(scope="module")
def engine(demo_float32: LoadedModel) -> Iterator[Engine]:
    lm = demo_float32
    kv_bytes = 256 * PAGE * 46_080  # 4096 tokens of float32 KV
    config = EngineConfig(kv_cache_bytes=kv_bytes, page_size=PAGE, attention_backend="torch_paged", threads=THREADS)
    eng = Engine(lm.model, lm.tokenizer, config, grammar_hook=XGrammarHook(max_threads=1)).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[str, str]]:
    with shared_redis() as (url, prefix):
        yield url, prefix


@pytest.fixture(scope="module")
def compiler(demo_float32: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(demo_float32.tokenizer, demo_float32.config.vocab_size)


async def collect(events: AsyncIterator[T]) -> list[T]:
    """All events of a stream."""
    return [e async for e in events]


async def whole(call: Awaitable[Response | ResponseEvents]) -> Response:
    """What a `create` answered whole (not streamed)."""
    r = await call
    assert isinstance(r, Response), r
    return r


async def streamed(call: Awaitable[Response | ResponseEvents]) -> ResponseEvents:
    """What a `create` answered as its events (`"stream": True`)."""
    r = await call
    assert not isinstance(r, Response), r
    return r


Run = Callable[[Callable[[SessionService], Awaitable[Any]]], Any]


@pytest.fixture
def run(engine: Engine, target: tuple[str, str], compiler: GrammarCompiler) -> Run:
    """Runs `body(service)` on a fresh store and event loop (the engine thread is shared)."""

    def go(body: Callable[[SessionService], Awaitable[T]]) -> T:
        async def main() -> T:
            store = SessionStore.connect(target[0], StoreConfig(prefix=target[1]))
            tok = engine.tokenizer
            assert tok is not None
            try:
                return await body(SessionService(engine, store, tok, compiler, detect_format(tok)))
            finally:
                await store.close()

        return asyncio.run(main())

    return go
