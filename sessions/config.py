"""Settings of the session store (`sessions.store`), the session service (`sessions.service`) and
its background workers (`sessions.tasks`): each default is written here once, and `longctx serve`'s
flags take theirs from these classes (`api.serve_args`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class StoreConfig:
    """Args:
    prefix: key prefix `P` (`--redis-prefix`).
    state_ttl_s: expiry of state keys, refreshed by every write (`--state-ttl`).
    lease_ttl_ms: expiry of a conversation lease; renew well within it.
    retry_budget_s: how long one call retries transient Redis errors before StoreUnavailable.
    max_append: most items one `append_items` (or `create`) call takes.
    max_chain: most responses `load_chain` walks before ChainTooLong.
    events_maxlen: events kept once a response is final.
    events_ttl_s: expiry of a final response's events.
    """

    prefix: str = "lc"
    state_ttl_s: int = 30 * 86_400
    lease_ttl_ms: int = 30_000
    retry_budget_s: float = 1.0
    max_append: int = 20
    max_chain: int = 1000
    events_maxlen: int = 10_000
    events_ttl_s: int = 86_400

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix must be non-empty without spaces, got {self.prefix!r}")
        for name in ("state_ttl_s", "lease_ttl_ms", "max_append", "max_chain", "events_maxlen", "events_ttl_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retry_budget_s < 0:
            raise ValueError(f"retry_budget_s must be >= 0, got {self.retry_budget_s}")


@dataclass(frozen=True)
class ImageConfig:
    """Image parts of requests (`sessions.image_parts`).

    Args:
        allow_urls: fetch http(s) `image_url`s (`--allow-image-urls`); else only data URLs.
        allow_private_urls: fetch from loopback, link-local, private and other non-public
            addresses too (`--allow-private-image-urls`).
        max_bytes: largest image, as sent or fetched (`--max-image-bytes`).
        max_pixels: most pixels (width x height) of an image (`--max-image-pixels`).
        max_images: most image parts in one request's input (`--max-images`).
        fetch_timeout_s: how long fetching one URL may take, redirects included.
    """

    allow_urls: bool = False
    allow_private_urls: bool = False
    max_bytes: int = 20 << 20
    max_pixels: int = 50_000_000
    max_images: int = 16
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")


@dataclass(frozen=True)
class ServiceConfig:
    """Args:
    model: the model name responses report.
    max_output_tokens: the cap of a response's output (`--max-output-tokens`); the default
        is min(context left, KV capacity left, this cap); an explicit value above it is a 400.
    lease_renew_s: how often a running turn renews its conversation's lease.
    hosted_tools: what a hosted tool (`web_search`, ...) gets (`--hosted-tools`): `ignore` (not
        offered to the model, echoed in the response) or `reject` (400 naming `tools[i].type`).
    kv_commit_wait_s: how long a turn's commit waits for its KV pages to reach Redis
        (`--kv-commit-wait-ms`), so the next turn on any server finds them; past it the pages
        still queued are marked pending and the next lookup waits for them.
    temperature, top_p: what a request that gives none samples with (`--override-generation-config`,
        vLLM's flag): clients such as the Codex CLI send no temperature, and a small model
        sampled at 1.0 may never end its reply.
    images: what image parts may hold and where they may come from (`ImageConfig`).
    """

    model: str = "longctx"
    max_output_tokens: int = 4096
    lease_renew_s: float = 10.0
    kv_commit_wait_s: float = 0.05
    hosted_tools: Literal["ignore", "reject"] = "ignore"
    temperature: float = 1.0
    top_p: float = 1.0
    images: ImageConfig = field(default_factory=ImageConfig)

    def __post_init__(self) -> None:
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        if not 0 <= self.temperature <= 2 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"default temperature must be in [0, 2] and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        if self.hosted_tools not in ("ignore", "reject"):
            raise ValueError(f"hosted_tools must be ignore or reject, got {self.hosted_tools!r}")
        if self.kv_commit_wait_s < 0:
            raise ValueError(f"kv_commit_wait_s must be >= 0, got {self.kv_commit_wait_s}")
        if self.lease_renew_s <= 0:
            raise ValueError(f"lease_renew_s must be > 0, got {self.lease_renew_s}")


@dataclass(frozen=True)
class WorkerConfig:
    """Args:
    workers: background-response workers per process (`--background-workers`; 0: none here).
    claim_idle_s: a job whose worker sent no heartbeat for this long (its server died) is taken
        over by another server (`--job-claim-idle-s`).
    heartbeat_s: how often a running job heartbeats and stale jobs are looked for (None:
        min(10 s, claim_idle_s / 3), so that a live worker is never taken for a dead one).
    """

    workers: int = 2
    claim_idle_s: float = 30.0
    heartbeat_s: float | None = None

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.claim_idle_s <= 0:
            raise ValueError(f"claim_idle_s must be > 0, got {self.claim_idle_s}")
        if self.heartbeat_s is not None and self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else min(10.0, self.claim_idle_s / 3)


GENERATION_KEYS = ("temperature", "top_p")


def generation_defaults(text: str | None) -> dict[str, float]:
    """`--override-generation-config JSON` as ServiceConfig fields; ValueError naming a bad key."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config: expected a JSON object")
    for key, v in value.items():
        if key not in GENERATION_KEYS:
            raise ValueError(
                f"--override-generation-config: {key}: not supported; supported: {', '.join(GENERATION_KEYS)}"
            )
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"--override-generation-config: {key}: expected a number, got {v!r}")
    return {k: float(v) for k, v in value.items()}
