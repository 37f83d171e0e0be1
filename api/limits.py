"""Per-tenant fairness in front of the engine's one admission limit (`--max-queued`).

A tenant may hold at most `--max-queued-per-tenant` (default half of `--max-queued`) requests
waiting, that is added to the engine and not yet producing tokens; one more is refused as the
engine's overload is, 429 with `Retry-After` and `x-should-retry: true`, so one busy tenant
cannot fill the whole queue. Chat requests and foreground responses (`sessions.waiting`) count;
background jobs wait in Redis and do not.
"""

from __future__ import annotations

from api.state import ServerState
from api.tenant_queue import TenantOverloaded, TenantQueue

__all__ = ["TenantOverloaded", "TenantQueue", "configure", "tenant_queue"]


def configure(state: ServerState) -> None:
    """Install the per-tenant queue routes read through `tenant_queue`."""
    state.tenant_queue = TenantQueue(state.options.per_tenant_queue)


def tenant_queue(state: ServerState) -> TenantQueue | None:
    return state.tenant_queue
