"""Retrying transient Redis failures within a time budget, then `StoreUnavailable`.

Transient: connection and timeout errors (a restart, a failover, a stall), and the error
replies a server gives while it cannot serve yet (`BUSY` running a script, `LOADING` its data,
`TRYAGAIN`, `MASTERDOWN`, `READONLY` during a failover). Each try is bounded by what is left of
the budget (plus `extra_s` for a blocking read), so a stalled server costs the caller the
budget, not a socket timeout. Out of memory is not transient: it is `StoreUnavailable` at once.

A write whose reply was lost may be tried again after it took effect, so every write script
is written to be replayed safely (see `sessions.store`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.exceptions as rex
from redis.commands.core import AsyncScript

from sessions.errors import NotFound, StoreUnavailable, from_script_error

T = TypeVar("T")

_TRANSIENT_REPLIES = ("BUSY ", "LOADING", "TRYAGAIN", "MASTERDOWN", "READONLY")


def is_transient(e: BaseException) -> bool:
    """Whether trying the same command again may succeed (see the module docstring)."""
    if isinstance(e, rex.ConnectionError | rex.TimeoutError | TimeoutError | ConnectionError):
        return True  # BusyLoadingError (LOADING) is a ConnectionError
    if isinstance(e, rex.TryAgainError | rex.ClusterDownError | rex.ReadOnlyError):
        return True
    return isinstance(e, rex.ResponseError) and str(e).startswith(_TRANSIENT_REPLIES)


class Retrier:
    """Args:
    budget_s: how long one call may keep trying, from its start.
    first_backoff_s: sleep after the first failure; doubles after each, up to max_backoff_s.
    """

    def __init__(self, budget_s: float = 1.0, first_backoff_s: float = 0.01, max_backoff_s: float = 0.2):
        self.budget_s = budget_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s

    async def run(self, op: Callable[[], Awaitable[T]], what: str, extra_s: float = 0.0) -> T:
        """`await op()`, tried again on transient failures until the budget is spent.

        Args:
            op: makes one try; called again for each retry.
            what: names the operation in the StoreUnavailable message.
            extra_s: time a try may take on top of the budget (a blocking read's wait).
        """
        deadline = time.monotonic() + self.budget_s
        backoff = self.first_backoff_s
        while True:
            left = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(left, 0.05) + extra_s):
                    return await op()
            except rex.OutOfMemoryError as e:
                raise StoreUnavailable(f"{what}: Redis is out of memory ({e})") from e
            except (redis.RedisError, TimeoutError, ConnectionError) as e:
                if not is_transient(e):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(f"{what}: Redis unavailable for {self.budget_s:g} s ({e!r})") from e
                await asyncio.sleep(min(backoff, left))
                backoff = min(2 * backoff, self.max_backoff_s)

    async def script(
        self, script: AsyncScript, keys: list[str], args: list[Any], subject: str, gone_ok: bool = False
    ) -> Any:
        """Run a Lua script with retries; its `LC_…` error replies become typed errors.

        Args:
            subject: the conversation or response id it works on (named in errors).
            gone_ok: the script deletes: a NotFound on a retry means the first try, whose reply
                was lost, did the delete, so the call answers None.
        """
        tries = 0

        async def once() -> Any:
            nonlocal tries
            tries += 1
            try:
                return await script(keys=keys, args=args)
            except rex.ResponseError as e:
                typed = from_script_error(e, subject)
                if typed is None:
                    raise
                if gone_ok and tries > 1 and isinstance(typed, NotFound):
                    return None
                raise typed from None

        return await self.run(once, subject)
