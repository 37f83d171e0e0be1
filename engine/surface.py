"""What the session layer and routes use of an engine: the in-process `Engine` and the engine
process's client (`engine/process/client.py`) both provide it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.request import RequestHandle
from engine.sampling_params import SamplingParams


class EngineSurface(Protocol):
    @property
    def max_model_len(self) -> int: ...

    @property
    def capacity_tokens(self) -> int: ...

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        matcher: Any = None,
        images: list[Any] | None = None,
    ) -> RequestHandle: ...

    def kv_commit_wait(self, timeout_s: float) -> bool: ...


class Generates:
    """`generate` for any engine surface, over its own `add_request` (the in-process `Engine`
    and the engine process's client share it)."""

    @contextlib.asynccontextmanager
    async def generate(
        self: EngineSurface,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        matcher: Any = None,
        images: list[Any] | None = None,
    ) -> AsyncIterator[RequestHandle]:
        """`async with engine.generate(ids, params) as handle:`; leaving the block before the
        final output (an exception, a cancelled task, a client gone) aborts the request.
        `images`: `ImageInput`s for a vision-language model's placeholders."""
        handle = self.add_request(
            prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt, matcher=matcher, images=images
        )
        async with handle:
            yield handle
