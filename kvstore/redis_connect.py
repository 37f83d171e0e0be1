"""One way to connect to Redis, a single server or a Redis Cluster, for the state and the KV tier.

`--redis-url` / `--kv-redis-url` may name a single server or any node of a Redis Cluster: a
node answers `CLUSTER INFO` with `cluster_enabled:1`-style facts (a single server answers an
error "cluster support disabled"), and the client is then redis-py's cluster client, which
learns the slot map from that node and routes each command by its key's slot. Unix-socket URLs
are always single servers (a cluster is reached over TCP).

Batched reads: a cluster refuses a multi-key command over keys of different slots, so
`mget` here splits the keys per slot (`mget_nonatomic`) on a cluster and sends one `MGET`
otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

__all__ = ["cluster_enabled", "connect", "connect_async", "is_cluster_client", "mget", "mget_async"]


def cluster_enabled(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at `url` is a node of a Redis Cluster (`CLUSTER INFO` answers)."""
    if urlparse(url).scheme not in ("redis", "rediss"):
        return False
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        info = client.execute_command("CLUSTER INFO")
    except redis.ResponseError:
        return False  # "ERR This instance has cluster support disabled"
    finally:
        client.close()
    if isinstance(info, dict):  # redis-py parses the reply
        return "cluster_state" in info
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:" in text


def _cluster_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    out.pop("retry", None)  # the cluster client retries by its own rules (MOVED, ASK, failover)
    return out


def connect(url: str, *, cluster: bool | None = None, **kwargs: Any) -> redis.Redis | redis.cluster.RedisCluster:
    """A blocking client for `url`: a `RedisCluster` when it names a cluster node, else `Redis`."""
    if cluster is None:
        cluster = cluster_enabled(url)
    if cluster:
        return redis.cluster.RedisCluster.from_url(url, **_cluster_kwargs(kwargs))
    return redis.Redis.from_url(url, **kwargs)


def connect_async(
    url: str, *, cluster: bool | None = None, **kwargs: Any
) -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster:
    """An asyncio client for `url` (detection is one short blocking `CLUSTER INFO`)."""
    if cluster is None:
        cluster = cluster_enabled(url)
    if cluster:
        return redis.asyncio.cluster.RedisCluster.from_url(url, **_cluster_kwargs(kwargs))
    return redis.asyncio.Redis.from_url(url, **kwargs)


def is_cluster_client(client: object) -> bool:
    return isinstance(client, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster)


def mget(client: Any, keys: Sequence[str]) -> list[Any]:
    """Values of `keys` in order (None where absent): per slot on a cluster, one MGET otherwise."""
    if not keys:
        return []
    if isinstance(client, redis.cluster.RedisCluster):
        return list(client.mget_nonatomic(list(keys)))
    return list(client.mget(list(keys)))


async def mget_async(client: Any, keys: Sequence[str]) -> list[Any]:
    """`mget` for an asyncio client."""
    if not keys:
        return []
    if isinstance(client, redis.asyncio.cluster.RedisCluster):
        return list(await client.mget_nonatomic(list(keys)))
    return list(await client.mget(list(keys)))
