"""Each tenant's count of waiting requests, and the 429 past its share (`api.limits`)."""

from __future__ import annotations

import threading
from collections import Counter

from api.errors import ErrorSpec, register, retry_after_headers


class TenantOverloaded(RuntimeError):
    """The tenant already holds its share of waiting requests; nothing was queued."""

    def __init__(self, tenant: str, limit: int, retry_after_s: float = 1.0):
        self.tenant, self.limit, self.retry_after_s = tenant, limit, retry_after_s
        super().__init__(f"this API key's tenant already has {limit} requests waiting (the per-tenant limit)")


register("TenantOverloaded", ErrorSpec(429, "rate_limit_error", "tenant_overloaded", headers=retry_after_headers))


class TenantQueue:
    """Counts each tenant's waiting requests (any thread)."""

    def __init__(self, limit: int):
        assert limit >= 1, limit  # `ServeOptions` checks the flag
        self.limit = limit
        self._waiting: Counter[str] = Counter()
        self._lock = threading.Lock()

    def enter(self, tenant: str) -> None:
        """One more waiting request of `tenant`; TenantOverloaded past the limit."""
        with self._lock:
            if self._waiting[tenant] >= self.limit:
                raise TenantOverloaded(tenant, self.limit)
            self._waiting[tenant] += 1

    def leave(self, tenant: str) -> None:
        with self._lock:
            self._waiting[tenant] -= 1
            if self._waiting[tenant] <= 0:
                del self._waiting[tenant]

    def waiting(self, tenant: str) -> int:
        with self._lock:
            return self._waiting[tenant]

    def snapshot(self) -> dict[str, int]:
        """Each tenant's waiting requests (tenants with none are left out)."""
        with self._lock:
            return dict(self._waiting)
