"""A step's logits to each request's next output: grammar mask, draw, then stop checks and text.

Every failure here belongs to one request and ends that request alone: a matcher that raises
or allows no token, a sampling error in one row, a detokenizer or matcher that raises while
the token is taken. Its output then finishes with `FinishReason.ERROR` and a message, and the
rest of the batch goes on. A token that ends a request without being emitted (end of
sequence, a stop token, one the grammar rejects) carries no logprob and is never streamed.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from engine.sampling.grammar import GrammarHook, new_bitmask
from engine.sampling.logits_processor import rows_without_token
from engine.sampling.sampler import Sampler, SamplerOutput, TokenLogprobs
from engine.stats import EngineStats

log = logging.getLogger("longctx.engine")

DEAD_END = "the output grammar allows no next token (dead end)"

_Drawn = tuple[int, TokenLogprobs | None] | Exception  # a row's (token id, logprobs), or why it failed


class OutputProcessor:
    """Args:
    sampler: draws the tokens.
    grammar_hook: fills the batch's grammar masks.
    eos_token_ids: end-of-sequence ids (a request ends on them unless `ignore_eos`).
    stats: where token counts and latencies are recorded.
    """

    def __init__(self, sampler: Sampler, grammar_hook: GrammarHook, eos_token_ids: set[int], stats: EngineStats):
        self.sampler = sampler
        self.grammar_hook = grammar_hook
        self.eos_token_ids = eos_token_ids
        self.stats = stats

    def __call__(self, reqs: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """One output per request, in order; `finish_reason` set on those that end here.

        Args:
            reqs: the B requests that draw a token this step.
            logits: [B, V] float32, their last positions' logits.
        """
        outs: list[RequestOutput | None] = [None] * len(reqs)
        live = list(range(len(reqs)))
        bitmask = None
        if any(r.matcher is not None for r in reqs):
            bitmask, failed = self._grammar_bitmask(reqs, logits.shape[-1])
            for i, why in failed.items():
                outs[i] = self._error(reqs[i], why)
            if failed:
                live = [i for i in live if i not in failed]
                logits, bitmask = logits[live], bitmask[live]
        for i, drawn in zip(live, self._sample([reqs[i] for i in live], logits, bitmask), strict=True):
            r = reqs[i]
            if isinstance(drawn, Exception):
                outs[i] = self._error(r, f"sampling failed: {drawn}")
                continue
            tok, lp = drawn
            top = None
            if lp is not None:
                top = [TokenLogprob(lp.token_id, lp.logprob, list(zip(lp.top_ids, lp.top_logprobs, strict=True)))]
            try:
                outs[i] = self._take(r, tok, top)
            except Exception as e:  # this request's matcher, detokenizer or stop checker
                log.exception("request %s failed taking token %d", r.id, tok)
                outs[i] = self._error(r, f"postprocessing failed: {e}")
        return [o for o in outs if o is not None]

    def _grammar_bitmask(self, reqs: list[Request], vocab: int) -> tuple[torch.Tensor, dict[int, str]]:
        """The batch's grammar masks [B, ceil(V/32)] int32, and the rows that cannot go on: a
        matcher that raised or allows no token (row -> why)."""
        matchers = [r.matcher for r in reqs]
        bitmask = new_bitmask(len(reqs), vocab)
        failed: dict[int, str] = {}
        try:
            self.grammar_hook.fill(matchers, bitmask)
        except Exception:  # a batch fill does not say which row failed: fill row by row to find out
            log.exception("grammar fill failed; retrying row by row")
            bitmask.fill_(-1)
            for row, m in enumerate(matchers):
                if m is None:
                    continue
                try:
                    m.fill_bitmask(bitmask, row)
                except Exception as e:
                    failed[row] = f"output grammar failed: {e}"
                    bitmask[row] = -1
        for row in rows_without_token(bitmask, vocab):
            failed.setdefault(row, getattr(matchers[row], "error", None) or DEAD_END)
        return bitmask, failed

    def _sample(self, reqs: list[Request], logits: torch.Tensor, bitmask: torch.Tensor | None) -> list[_Drawn]:
        if not reqs:
            return []
        try:
            out = self._draw(reqs, logits, bitmask)
            return list(zip(out.token_ids, out.logprobs, strict=True))
        except Exception:  # find the rows at fault; a seeded draw does not depend on its batch
            log.exception("sampling a batch of %d failed; retrying row by row", len(reqs))
        results: list[_Drawn] = []
        for i, r in enumerate(reqs):
            try:
                one = self._draw([r], logits[i : i + 1], None if bitmask is None else bitmask[i : i + 1])
                results.append((one.token_ids[0], one.logprobs[0]))
            except Exception as e:
                results.append(e)
        return results

    def _draw(self, reqs: list[Request], logits: torch.Tensor, bitmask: torch.Tensor | None) -> SamplerOutput:
        params = [r.params for r in reqs]
        return self.sampler(logits, params, [r.prompt_ids for r in reqs], [r.output_ids for r in reqs], bitmask)

    def _take(self, r: Request, tok: int, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """Emit the drawn token, or end the request without it; `logprobs` go with emitted ids only."""
        self._time_token(r)
        p = r.params
        finish: FinishReason | None = None
        error = None
        ids: list[int] = []
        text = ""
        if p.max_tokens == 0:
            finish = FinishReason.LENGTH
        elif (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            finish = FinishReason.STOP  # the end token is not emitted, nor is its logprob
        elif r.matcher is not None and not r.matcher.accept_token(tok):
            error = getattr(r.matcher, "error", None) or f"token {tok} rejected by the output grammar"
            finish = FinishReason.ERROR  # the rejected token is never emitted
        else:
            r.output_ids.append(tok)
            ids = [tok]
            self.stats.generated_tokens += 1
            if r.detok is not None:
                text, hit = r.stopper.feed(r.detok.add(tok))
                if hit:
                    finish = FinishReason.STOP
            if finish is None and len(r.output_ids) >= p.max_tokens:
                finish = FinishReason.LENGTH
            if finish is None and r.matcher is not None and r.matcher.is_terminated():
                finish = FinishReason.STOP
        if finish is not None and r.detok is not None and not r.stopper.stopped:
            text += r.stopper.feed(r.detok.flush())[0] + r.stopper.flush()
        lps = logprobs if ids else None
        return RequestOutput(r.id, ids, text, lps, finish, len(r.prompt_ids), r.cached_tokens, error)

    def _time_token(self, r: Request) -> None:
        now = time.monotonic()
        if r.first_token_time is None:
            r.first_token_time = now
            self.stats.ttft.observe(now - r.arrival)
        elif r.last_token_time is not None:
            self.stats.inter_token.observe(now - r.last_token_time)
        r.last_token_time = now

    @staticmethod
    def _error(r: Request, error: str) -> RequestOutput:
        log.warning("request %s failed: %s", r.id, error)
        return RequestOutput(r.id, [], "", None, FinishReason.ERROR, len(r.prompt_ids), r.cached_tokens, error)
