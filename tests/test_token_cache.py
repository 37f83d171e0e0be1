"""`store: false` with the whole history re-sent (as the Codex CLI does): the token cache gives
the next prompt the previous turn's ids, so nearly all of it is served from the prefix cache;
unit checks of where a rendered prompt can continue an earlier turn."""

from __future__ import annotations

from typing import Any

import msgspec

from sessions.context import load_context
from sessions.render import encode
from sessions.requests import decode_request
from sessions.service import SessionService
from sessions.token_cache import boundaries
from tests.session_engine import PAGE, TENANT, Run, compiler, engine, run, target, whole

__all__ = ["compiler", "engine", "run", "target"]  # fixtures

INSTRUCTIONS = "You are a terse assistant. " * 40


def test_boundaries_are_before_each_marker_latest_first() -> None:
    text = "<s>a<|im_end|>b<|im_end|>c"
    assert boundaries(text, ["<|im_end|>"]) == [15, 4]
    assert boundaries("no marker", ["<|im_end|>"]) == []


def test_resent_history_continues_the_previous_ids(run: Run) -> None:
    async def body(svc: SessionService) -> None:
        history: list[Any] = [{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": "Hi!"}]
        ask = {"input": history, "store": False, "temperature": 0, "max_output_tokens": 48}
        first = await whole(svc.create(TENANT, ask))
        assert first.status == "completed" and first.usage is not None, first
        seen = first.usage.input_tokens + first.usage.output_tokens
        for question in ("And what is 2 + 2?", "Thanks. One more word?"):
            history += [msgspec.to_builtins(i) for i in first.output]  # the output items as a client holds them
            history.append({"role": "user", "content": question})
            nxt = await whole(svc.create(TENANT, {"input": history, "store": False, "temperature": 0,
                                            "max_output_tokens": 48}))  # fmt: skip
            assert nxt.usage is not None
            cached = nxt.usage.input_tokens_details.cached_tokens
            assert cached >= (seen - 1) // PAGE * PAGE, (cached, seen)  # every full page of the last turn
            assert cached >= 0.9 * nxt.usage.input_tokens
            first, seen = nxt, nxt.usage.input_tokens + nxt.usage.output_tokens

    run(body)


def test_cached_ids_win_over_a_retokenization(run: Run) -> None:
    """Ids a reply was generated as, different from how its text tokenizes anew, are what the
    next prompt continues; without the cache it is rendered whole."""

    async def body(svc: SessionService) -> None:
        tok, history = (
            svc.tokenizer,
            [{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": "Hi"}],
        )
        first = decode_request({"input": history, "store": False})
        p1 = (await svc.fitter.fit(TENANT, "resp_1", first, await load_context(svc.store, TENANT, first), [])).prompt
        reply = "Hello there, friend"
        odd = [i for c in reply for i in encode(tok, c)]  # one character a token: not how it retokenizes
        assert odd != encode(tok, reply)
        await svc.fitter.remember(TENANT, [*p1.ids, *odd])
        again = [*history, {"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
        second = decode_request({"input": again, "store": False})
        ctx = await load_context(svc.store, TENANT, second)
        p2 = (await svc.fitter.fit(TENANT, "resp_2", second, ctx, [])).prompt
        assert p2.reused == len(p1.ids) + len(odd) and p2.ids[: p2.reused] == [*p1.ids, *odd]
        svc.fitter.tokens = None
        assert (await svc.fitter.fit(TENANT, "resp_3", second, ctx, [])).prompt.reused == 0

    run(body)
