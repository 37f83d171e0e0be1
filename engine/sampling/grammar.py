"""The structured-output hook: per-request matchers that restrict the next token.

The engine knows nothing of grammars. A request may carry a `Matcher`; each step the
engine asks the `GrammarHook` to fill the batch's bitmask `[B, ceil(V/32)]` int32 (V =
logits width; bit j of word w set = token 32*w + j allowed; rows without a matcher stay all
ones), masks the logits, samples, then feeds the chosen token back with `accept_token`.
`tools/grammar.py` implements these with xgrammar.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Matcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of this matcher's next token into `bitmask[row]`."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False when the token is not allowed (the request then fails)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (used when a request is recomputed)."""

    def is_terminated(self) -> bool:
        """True once the grammar has reached its end: the request stops."""


class GrammarHook:
    """Fills the masks of a whole batch; the default asks each matcher for its row.

    A backend that can fill many rows at once (xgrammar's batch matcher) overrides `fill`.
    """

    def fill(self, matchers: list[Matcher | None], bitmask: torch.Tensor) -> None:
        for row, m in enumerate(matchers):
            if m is not None:
                m.fill_bitmask(bitmask, row)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed: [batch, ceil(V/32)] int32 of -1 (all bits set)."""
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)
