"""Conversations, items, leases and responses in Redis (redis.asyncio): the session store.

Key layout (`P` = prefix, default `lc`; `c` a conversation id, `r` a response id; `{t}` the
hash tag of the id's slot tag, `sessions.ids.slot_tag`: a response in a conversation shares the
conversation's tag, a response chained by `previous_response_id` its previous response's):

    key                       type    holds
    P:{t}:conv:c              hash    tenant, created_at, metadata (JSON), version, next (position),
                                      last_response (whose tokens match the items; '' if none),
                                      fence (the lease fence counter)
    P:{t}:conv:c:order        zset    item ids scored by position (a deleted item leaves a gap)
    P:{t}:conv:c:items        hash    item id -> item JSON (`sessions.items`; a data-URL image part
                                      holds a reference: `sessions.image_store`)
    P:{t}:conv:c:images       hash    sha256 -> how many of the conversation's image parts point at it
    P:{t}:conv:c:lease        string  `r:fence` of the response running on c; PX 30 s, renewed
    P:{t}:resp:r              hash    tenant, status, response (JSON), prev, conv, input_ids (JSON),
                                      prompt_ids, output_ids (uint32 little-endian), committed
    P:{t}:resp:r:items        hash    the response's input items, id -> JSON (also when the turn
                                      was in a conversation, so input_items survive item deletes)
    P:{t}:resp:r:images       hash    sha256 -> how many of its input image parts point at it
    P:{t}:img:<sha256>        hash    one image's bytes (data) and its reference count (refs), once
                                      per slot tag (`sessions.image_store`)
    P:{t}:resp:r:lease        string  set while a stored foreground response outside a
                                      conversation runs; PX 30 s, renewed, dropped at its commit
    P:{t}:resp:r:events       stream  events by sequence number (`sessions.streams`)
    P:jobs                    stream  background responses, group `workers` (`sessions.streams`)
    P:idem:<tenant>:<key>     string  Idempotency-Key -> response id, 24 h
    P:secret, P:rkey          string  HMAC key of compaction items, AES key of sealed reasoning;
                                      SET NX once, never expire
    P:layout                  string  "2": this key layout (`longctx state migrate` converts
                                      the layout before it, `P:conv:c`, `P:resp:r`, `P:fence`)

Rules:
- Every change of more than one key is one Lua script (`sessions.scripts`, EVALSHA). A script
  checks everything first (tenant, lease fence, duplicate item ids, a final response), so a
  failed check writes nothing. The scripts recognise their own replay (`sessions.retry` tries
  a write again when its reply was lost) and answer as the first run did.
- Every read, and every change a client asks for, takes the tenant and answers NotFound for
  another tenant's id (lease, event and job calls, which the server makes for its own running
  responses, take the ids it holds).
- One running response per conversation: `acquire_lease` gives a fence, `renew_lease` keeps
  it, `commit_turn` writes the turn only while the fence still holds the lease (else
  LeaseLost, nothing written) and releases it. A response id that asks again takes the lease
  over with a new fence (a background job rerun after its worker died).
- Transient Redis errors are retried for `retry_budget_s` (1 s), then StoreUnavailable.
- The conversation version goes up with every change of its items and never goes back.
- State keys carry `state_ttl_s`, refreshed by every write to them; an image's TTL is refreshed
  by every write to a holder (conversation items, a response's input items) that points at it.
- `conversations.load` and `responses.load_chain` are single read scripts (one round trip,
  one snapshot) that follow the ids they read (the last response, `previous_response_id`
  links): those share the slot of the keys the script is given, so the store runs on one
  Redis or on a Redis Cluster (`kvstore.redis_connect`). Cross-slot work is single-key by
  design: the job stream (`P:jobs`, one key: its node queues every background job), the
  idempotency keys, the shared secrets; a lease's fence counter lives in its conversation's
  hash. A chain that continues a response written before this layout (no shared tag) works on
  one Redis only; `longctx state migrate` rewrites such a database.
"""

from __future__ import annotations

import secrets
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstore.redis_connect import connect_async, is_cluster_client
from sessions.config import StoreConfig
from sessions.conversations import ConversationContext, ConversationStore
from sessions.errors import UnsuitableServer
from sessions.keys import LAYOUT, Keys
from sessions.responses import Chain, ChainLink, ResponseStore
from sessions.retry import Retrier
from sessions.scripts import Scripts
from sessions.streams import Event, EventLog, Job, JobQueue

__all__ = ["Chain", "ChainLink", "ConversationContext", "Event", "Job", "SessionStore", "StoreConfig"]

IDEMPOTENCY_TTL_S = 86_400


class SessionStore:
    """The session store on one Redis client; build it with `SessionStore.connect(url)`.

    Attributes:
        conversations: conversations, items, leases, commits (`ConversationStore`).
        responses: stored responses and `previous_response_id` chains (`ResponseStore`).
        events: each response's event stream (`EventLog`).
        jobs: the background-job queue (`JobQueue`).
    """

    def __init__(self, client: Redis, config: StoreConfig | None = None):
        self.client = client
        self.config = config = config or StoreConfig()
        self.keys = keys = Keys(config.prefix)
        self.retrier = retrier = Retrier(config.retry_budget_s)
        scripts = Scripts(client)
        self.conversations = ConversationStore(client, keys, retrier, scripts, config)
        self.responses = ResponseStore(client, keys, retrier, scripts, config)
        self.events = EventLog(client, keys, retrier, scripts, config)
        self.jobs = JobQueue(client, keys, retrier, scripts)
        self._scripts = scripts
        self._secret: bytes | None = None
        self._rkey: bytes | None = None

    @classmethod
    def connect(cls, url: str, config: StoreConfig | None = None) -> SessionStore:
        """A store on a new client for `url` (redis:// or unix://; a Redis Cluster node gives a
        cluster client). redis-py's own retries are off: this store retries, within
        `retry_budget_s`."""
        client = connect_async(url, socket_connect_timeout=1.0, socket_timeout=10.0, retry=Retry(NoBackoff(), 0))
        return cls(client, config)  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.client.aclose()

    async def check_server(self) -> None:
        """Refuse a server that could lose conversations: UnsuitableServer unless it runs
        `maxmemory-policy noeviction` and Redis 7 or later."""
        infos = await self.retrier.run(self._infos, "check_server")
        for info in infos:
            self._check_info(info)
        await self.check_layout()

    async def _infos(self) -> list[dict[str, Any]]:
        if is_cluster_client(self.client):  # every master holds some conversations
            replies = await self.client.info(target_nodes="primaries")  # type: ignore[call-arg]
            return list(replies.values()) if isinstance(replies, dict) and "redis_version" not in replies else [replies]
        return [await self.client.info()]

    async def check_layout(self) -> None:
        """Refuse a database written with the key layout before hash tags (`P:conv:c`): its
        conversations would seem gone. `longctx state migrate` rewrites it; a database with no
        state keys is marked with this layout (`P:layout`)."""
        if await self.client.get(self.keys.layout) == LAYOUT.encode():
            return
        if not is_cluster_client(self.client):
            old = [await self._first(f"{self.keys.prefix}:{kind}:*") for kind in ("conv", "resp")]
            if any(old):
                raise UnsuitableServer(
                    f"the state Redis holds conversations in the key layout before hash tags "
                    f"({self.keys.prefix}:conv:...); run `longctx state migrate --redis-url URL "
                    f"--redis-prefix {self.keys.prefix}` once (with the servers stopped), then start again"
                )
        await self.client.set(self.keys.layout, LAYOUT)

    async def _first(self, match: str) -> bytes | None:
        """The first key matching `match`, if any (SCAN)."""
        async for key in self.client.scan_iter(match=match, count=1000):
            return bytes(key)
        return None

    @staticmethod
    def _check_info(info: dict[str, Any]) -> None:
        policy = info.get("maxmemory_policy")
        if policy != "noeviction":
            raise UnsuitableServer(
                f"the session Redis runs maxmemory-policy {policy!r}, so it may evict conversations; "
                "run it with `maxmemory-policy noeviction` (and keep the KV-cache Redis a separate server)"
            )
        version = str(info.get("redis_version", "0"))
        if int(version.split(".")[0]) < 7:
            raise UnsuitableServer(f"the session Redis is version {version}; the store needs 7.0 or later")

    async def remember_idempotency(self, tenant: str, key: str, resp_id: str) -> str | None:
        """Bind an Idempotency-Key to `resp_id` for 24 h (SET NX); returns the response id it was
        already bound to (nothing changes then), or None."""

        async def once() -> Any:
            return await self.client.set(self.keys.idem(tenant, key), resp_id, nx=True, ex=IDEMPOTENCY_TTL_S, get=True)

        old = await self.retrier.run(once, "idempotency")
        return None if old is None or old.decode() == resp_id else str(old.decode())

    async def forget_idempotency(self, tenant: str, key: str, resp_id: str) -> None:
        """Unbind the key if it is still bound to `resp_id` (its request failed before any write)."""
        keys = [self.keys.idem(tenant, key)]
        await self.retrier.script(self._scripts.forget_idempotency, keys, [resp_id], "idempotency")

    async def compaction_secret(self) -> bytes:
        """The HMAC key of compaction items: made once (SET NX), shared by every server."""
        if self._secret is None:
            self._secret = await self._shared_key(self.keys.secret)
        return self._secret

    async def reasoning_key(self) -> bytes:
        """The AES-256-GCM key of reasoning items' `encrypted_content` (`sessions.sealed`): made
        once (SET NX, `P:rkey`), shared by every server."""
        if self._rkey is None:
            self._rkey = await self._shared_key(self.keys.rkey)
        return self._rkey

    async def _shared_key(self, key: str) -> bytes:
        async def once() -> bytes:
            await self.client.set(key, secrets.token_bytes(32), nx=True)
            value = await self.client.get(key)
            assert isinstance(value, bytes)
            return value

        return await self.retrier.run(once, "secret")
