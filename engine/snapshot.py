"""A point-in-time copy of the engine's load, for metrics and admission from other threads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Published by the engine thread after every step; readers only swap in the reference, so
    they never see scheduler lists mid-change.

    Attributes:
        running, waiting, loading: requests in each scheduler state at the end of the step.
        queued: requests added and not yet running or finished (what `max_queued` bounds),
            counting those still in the inbox.
        free_pages, total_pages: device KV pages (free ones include cached, revivable pages).
        preemptions: requests preempted so far.
        prompt_tokens_computed, generated_tokens, finished, steps: counters since start.
    """

    running: int = 0
    waiting: int = 0
    loading: int = 0
    queued: int = 0
    free_pages: int = 0
    total_pages: int = 0
    preemptions: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0
