"""Redis key names of the session store (the layout is documented in `sessions.store`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "lc"

    def conv(self, c: str) -> str:
        return f"{self.prefix}:conv:{c}"

    def order(self, c: str) -> str:
        return f"{self.prefix}:conv:{c}:order"

    def items(self, c: str) -> str:
        return f"{self.prefix}:conv:{c}:items"

    def lease(self, c: str) -> str:
        return f"{self.prefix}:conv:{c}:lease"

    def conversation(self, c: str) -> list[str]:
        """The three keys of a conversation's state: hash, order zset, items hash."""
        return [self.conv(c), self.order(c), self.items(c)]

    def resp(self, r: str) -> str:
        return f"{self.prefix}:resp:{r}"

    def resp_items(self, r: str) -> str:
        return f"{self.prefix}:resp:{r}:items"

    def resp_lease(self, r: str) -> str:
        return f"{self.prefix}:resp:{r}:lease"

    def events(self, r: str) -> str:
        return f"{self.prefix}:resp:{r}:events"

    def idem(self, tenant: str, key: str) -> str:
        return f"{self.prefix}:idem:{tenant}:{key}"

    @property
    def fence(self) -> str:
        return f"{self.prefix}:fence"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def secret(self) -> str:
        return f"{self.prefix}:secret"
