"""Tokenization off the event loop: encode and chat templates on a worker thread.

Rendering and tokenizing a long conversation takes milliseconds to a second (a 100k-token
history, a Jinja template over many items); on the asyncio loop that would stall every other
stream. The session layer awaits these instead. One worker by default: a transformers fast
tokenizer may reconfigure its Rust state (padding, truncation) on each call, and two threads
doing so at once fail with "Already borrowed"; the loop only needs the work off its thread.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.loading.tokenizer import Tokenizer


class TokenizerPool:
    """Args:
    tokenizer: the model's tokenizer.
    max_workers: worker threads (see the module docstring before raising it).
    """

    def __init__(self, tokenizer: Tokenizer, max_workers: int = 1):
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="longctx-tokenizer")

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the worker thread: for work that uses the tokenizer (render a
        template, then encode) beyond the three calls below."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str) -> list[int]:
        """`Tokenizer.encode` on the worker thread."""
        ids: list[int] = await self.run(self.tokenizer.encode, text)
        return ids

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`Tokenizer.decode` on the worker thread."""
        text: str = await self.run(self.tokenizer.decode, ids, skip_special_tokens)
        return text

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """`Tokenizer.apply_chat_template` (render and tokenize) on the worker thread."""
        ids: list[int] = await self.run(self.tokenizer.apply_chat_template, messages, tools, add_generation_prompt)
        return ids

    def close(self) -> None:
        """Finish queued work and stop the worker."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
