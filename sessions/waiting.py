"""A foreground turn's place among its tenant's waiting requests.

The server counts, per tenant, the requests added to the engine that have not yet produced a
token (`api.tenant_queue.TenantQueue`, `--max-queued-per-tenant`); a foreground response takes a place
before anything is written or queued and gives it back at its first output or its end, whichever
comes first; a chat request (`api.chat`) holds one the same way. Background jobs wait in Redis
and take none. The gate is given by the server; this layer only needs its two calls.
"""

from __future__ import annotations

from typing import Protocol


class WaitingGate(Protocol):
    def enter(self, tenant: str) -> None:
        """Take a place for `tenant`, or raise (the server's 429) with nothing taken."""

    def leave(self, tenant: str) -> None:
        """Give back a place taken by `enter`."""


class WaitingPlace:
    """One turn's place; `release` is idempotent, so every path may call it."""

    def __init__(self, gate: WaitingGate | None, tenant: str):
        self.gate, self.tenant, self.held = gate, tenant, False
        if gate is not None:
            gate.enter(tenant)
            self.held = True

    def release(self) -> None:
        if self.held and self.gate is not None:
            self.held = False
            self.gate.leave(self.tenant)
