"""The router's `/metrics` (Prometheus text): per-replica requests and health, affinity hits
and misses, failovers (a request moved off its affine replica because it was down or
overloaded, or a connection to it failed), 429 retries."""

from __future__ import annotations

from dataclasses import dataclass

from api.router.replicas import Replicas


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
    lines += [
        "# HELP longctx_router_requests_total requests sent to each replica",
        "# TYPE longctx_router_requests_total counter",
    ]
    lines += [f'longctx_router_requests_total{{replica="{r.url}"}} {r.requests}' for r in replicas.all]
    lines += [
        "# HELP longctx_router_replica_up whether the replica is in rotation",
        "# TYPE longctx_router_replica_up gauge",
    ]
    lines += [f'longctx_router_replica_up{{replica="{r.url}"}} {int(r.healthy)}' for r in replicas.all]
    lines += [
        "# HELP longctx_router_in_flight requests in flight on each replica",
        "# TYPE longctx_router_in_flight gauge",
    ]
    lines += [f'longctx_router_in_flight{{replica="{r.url}"}} {r.in_flight}' for r in replicas.all]
    lines += [
        "# HELP longctx_router_published_keys affinity keys the replica published as served lately (registry)",
        "# TYPE longctx_router_published_keys gauge",
    ]
    lines += [f'longctx_router_published_keys{{replica="{r.url}"}} {len(r.keys)}' for r in replicas.all]
    lines += [
        "# HELP longctx_router_published_prefixes prompt-prefix fingerprints the replica published (registry)",
        "# TYPE longctx_router_published_prefixes gauge",
    ]
    lines += [f'longctx_router_published_prefixes{{replica="{r.url}"}} {len(r.prefixes)}' for r in replicas.all]
    return "\n".join(lines) + "\n"
