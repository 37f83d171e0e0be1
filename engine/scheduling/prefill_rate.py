"""How fast this engine prefills, measured: what recomputing a prefix would cost.

The scheduler weighs waiting for KV pages from a tier against recomputing them
(`engine.kv_connector.lookup_plan`); the tier measures its side, this measures ours:
tokens computed per second of the steps that prefill (EWMA, each step weighted by its
size, so a step of a few tokens, dominated by fixed overhead, moves it little).
Steps are timed on the host: on CUDA a step that does not sample is not synchronized,
so the rate there is optimistic and lookups wait less, never more.

The first step of `calibrate_tokens` or more replaces the prior outright (the server's warm-up
runs one): a fresh replica whose first request restores a long prefix from Redis must not
weigh the wait against a guess (on a loaded CPU the guess of 1,000 tokens/s gave a deadline
several times shorter than the recompute it stood for, and the lookup gave up half-way).
"""

from __future__ import annotations


class PrefillRate:
    """Args:
    prior_tokens_per_s: the estimate before the first prefill (a slow CPU's rate, so a
        fresh engine prefers a tier's pages to recomputing).
    alpha: weight of a step of `full_step_tokens` tokens or more (EWMA).
    calibrate_tokens: the first step at least this large replaces the prior.
    fixed: keep the prior whatever the steps take (`EngineConfig.recompute_tokens_per_s`).
    """

    def __init__(
        self,
        prior_tokens_per_s: float = 1000.0,
        alpha: float = 0.3,
        full_step_tokens: int = 256,
        calibrate_tokens: int = 32,
        fixed: bool = False,
    ):
        self.tokens_per_s = prior_tokens_per_s
        self.alpha = alpha
        self.full_step_tokens = full_step_tokens
        self.calibrate_tokens = calibrate_tokens
        self.measured = False  # a step of `calibrate_tokens` or more has replaced the prior
        self.fixed = fixed

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step that computed `num_tokens` (prefill chunks and any decodes) in `seconds`."""
        if num_tokens <= 0 or seconds <= 0 or self.fixed:
            return
        if not self.measured and num_tokens >= self.calibrate_tokens:
            self.tokens_per_s = num_tokens / seconds
            self.measured = True
            return
        weight = self.alpha * min(1.0, num_tokens / self.full_step_tokens)
        self.tokens_per_s = (1 - weight) * self.tokens_per_s + weight * (num_tokens / seconds)

    def seconds(self, num_tokens: int) -> float:
        """Expected seconds to prefill `num_tokens` tokens."""
        return num_tokens / self.tokens_per_s
