"""Redis key names of the session store (the layout is documented in `sessions.store`).

Every key of a conversation or a response carries the hash tag `{t}`, `t` the id's slot tag
(`sessions.ids.slot_tag`), so on a Redis Cluster each Lua script's keys lie in one slot."""

from __future__ import annotations

from dataclasses import dataclass

from sessions.ids import slot_tag

LAYOUT = "2"  # the value of `P:layout` on a database written with this layout


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "lc"

    def _conv(self, c: str) -> str:
        return f"{self.prefix}:{{{slot_tag(c)}}}:conv:{c}"

    def conv(self, c: str) -> str:
        return self._conv(c)

    def order(self, c: str) -> str:
        return f"{self._conv(c)}:order"

    def items(self, c: str) -> str:
        return f"{self._conv(c)}:items"

    def lease(self, c: str) -> str:
        return f"{self._conv(c)}:lease"

    def images(self, c: str) -> str:
        return f"{self._conv(c)}:images"

    def conversation(self, c: str) -> list[str]:
        """The four keys of a conversation's state: hash, order zset, items hash, image index."""
        return [self.conv(c), self.order(c), self.items(c), self.images(c)]

    def resp(self, r: str) -> str:
        return f"{self.prefix}:{{{slot_tag(r)}}}:resp:{r}"

    def resp_items(self, r: str) -> str:
        return f"{self.resp(r)}:items"

    def resp_images(self, r: str) -> str:
        return f"{self.resp(r)}:images"

    def image(self, any_id: str, sha256: str) -> str:
        """The bytes of one image (`sessions.image_store`), in the slot of `any_id`'s tag."""
        return f"{self.prefix}:{{{slot_tag(any_id)}}}:img:{sha256}"

    def resp_lease(self, r: str) -> str:
        return f"{self.resp(r)}:lease"

    def events(self, r: str) -> str:
        return f"{self.resp(r)}:events"

    def idem(self, tenant: str, key: str) -> str:
        return f"{self.prefix}:idem:{tenant}:{key}"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def secret(self) -> str:
        return f"{self.prefix}:secret"

    @property
    def rkey(self) -> str:
        return f"{self.prefix}:rkey"

    @property
    def layout(self) -> str:
        return f"{self.prefix}:layout"
