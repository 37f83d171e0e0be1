"""The router's `/metrics` (Prometheus text): per-replica requests and health, affinity hits
and misses, failovers (a request moved off its affine replica because it was down or
overloaded, or a connection to it failed), 429 retries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from api.router.replicas import Replica, Replicas


@dataclass
class RouterCounters:
    affinity_hits: int = 0
    affinity_misses: int = 0  # a key the router had not seen (or its replica forgot)
    failovers: int = 0
    retried_429: int = 0
    prefix_hits: int = 0  # keyless requests sent where their prompt's leading text went before
    no_replica: int = 0  # requests answered 503: no healthy replica


def render(c: RouterCounters, replicas: Replicas) -> str:
    lines = []
    for name, value, help_ in (
        ("affinity_hits", c.affinity_hits, "requests sent to the replica that served their key last"),
        ("affinity_misses", c.affinity_misses, "requests with a key the router had no replica for"),
        ("prefix_hits", c.prefix_hits, "keyless requests sent to the replica that served their prompt's prefix"),
        ("failovers", c.failovers, "requests moved off their replica (down, overloaded, connection failed)"),
        ("retried_429", c.retried_429, "429 answers retried once on another replica"),
        ("no_replica", c.no_replica, "requests answered 503 for want of a healthy replica"),
    ):
        lines += [f"# HELP longctx_router_{name}_total {help_}", f"# TYPE longctx_router_{name}_total counter"]
        lines.append(f"longctx_router_{name}_total {value}")
    per_replica: tuple[tuple[str, str, str, Callable[[Replica], int]], ...] = (
        ("requests_total", "counter", "requests sent to each replica", lambda r: r.requests),
        ("replica_up", "gauge", "whether the replica is in rotation", lambda r: int(r.healthy)),
        ("in_flight", "gauge", "requests in flight on each replica", lambda r: r.in_flight),
        ("published_keys", "gauge", "affinity keys the replica published as served lately (registry)",
         lambda r: len(r.keys)),
        ("published_prefixes", "gauge", "prompt-prefix fingerprints the replica published (registry)",
         lambda r: len(r.prefixes)),
    )  # fmt: skip
    for series, kind, text, of in per_replica:
        lines += [f"# HELP longctx_router_{series} {text}", f"# TYPE longctx_router_{series} {kind}"]
        lines += [f'longctx_router_{series}{{replica="{r.url}"}} {of(r)}' for r in replicas.all]
    return "\n".join(lines) + "\n"
