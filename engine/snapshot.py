"""A point-in-time copy of the engine's load, for metrics and admission from other threads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Published by the engine thread after every step; readers only swap in the reference, so
    they never see scheduler lists mid-change.

    Attributes:
        running, waiting, loading: requests in each scheduler state at the end of the step.
        queued: requests added and not yet running or finished (what `max_queued` bounds),
            counting those still in the inbox; `Engine.snapshot` reads it live.
        free_pages, total_pages: device KV pages (free ones include cached, revivable pages).
        preemptions: requests preempted so far.
        prompt_tokens_computed, generated_tokens, finished, steps: counters since start.
        request_pages: per running, loading or pinned waiting request id, the device pages it holds (a
            windowed model's requests release those behind the window).
        peak_request_pages: the most device pages one request held during any step so far
            (counted when a step's pages were allocated: a prefill chunk's pages included).
        reclaimed_pages: pages released behind a sliding window so far.
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
    request_pages: dict[str, int] = field(default_factory=dict)
    peak_request_pages: int = 0
    reclaimed_pages: int = 0

    @property
    def held_pages(self) -> int:
        """Device pages referenced by requests (free ones, cached or not, excluded)."""
        return self.total_pages - self.free_pages
