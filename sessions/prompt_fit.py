"""A turn's context to its prompt, kept within the compaction threshold and the context limit.

`PromptFitter.fit` renders the context from its latest compaction (`sessions.compaction.view`),
then, past the request's `compact_threshold`, shortens old tool outputs and else summarises the
older turns into a new compaction item; with `truncation: "auto"` it then drops the oldest
turns until the prompt fits. `PromptFitter.compact` is `POST /v1/responses/compact`. The rules
are in `sessions.compaction`'s docstring.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from engine.loading.tokenizer import Tokenizer
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.surface import EngineSurface
from engine.tokenizer_pool import TokenizerPool
from sessions.compaction import (
    SUMMARY_MAX_TOKENS,
    Payload,
    boundary,
    drop_oldest_turn,
    payloads,
    shorten,
    shortened_in,
    sign,
    summary_messages,
    view,
    with_summary,
)
from sessions.context import TurnContext
from sessions.ids import new_id
from sessions.image_parts import ImageParts
from sessions.image_prompt import image_prompt
from sessions.items import Compaction, Item, images_of
from sessions.models import now
from sessions.render import Prompt, build_prompt, decode_exact, encode, render_text, to_messages
from sessions.requests import ResponseRequest
from sessions.store import SessionStore
from sessions.token_cache import TokenCache
from tools.schema import ToolSpec


class Fitted(NamedTuple):
    """A turn's prompt, and the compaction item made for it (None if none)."""

    prompt: Prompt
    compaction: Compaction | None


class SummaryFailed(RuntimeError):
    """The summary request ended in an engine error."""


class PromptFitter:
    def __init__(
        self, engine: EngineSurface, store: SessionStore, tokenizer: Tokenizer, tokens: TokenCache | None = None
    ):
        self.engine, self.store, self.tokenizer = engine, store, tokenizer
        self.tokenizing = TokenizerPool(tokenizer)  # one worker: a fast tokenizer is not thread-safe
        self.tokens = tokens
        # image parts: read and checked by `images`, preprocessed by `processor` (None: a text model)
        self.images: ImageParts | None = None
        self.processor: Any = None
        # where a turn's output ends in a rendering: before the end-of-turn (eos) markers
        self.markers = [decode_exact(tokenizer, [i]) for i in tokenizer.eos_token_ids]

    async def _cached_ids(self, tenant: str, text: str) -> list[int] | None:
        """The ids of the longest earlier turn `text` continues (`sessions.token_cache`), if cached."""
        assert self.tokens is not None
        for cut, ids in await self.tokens.find(tenant, text, self.markers):
            if await self.tokenizing.run(decode_exact, self.tokenizer, ids) == text[:cut]:
                return ids
        return None

    async def remember(self, tenant: str, ids: list[int]) -> None:
        """Keep a finished turn's prompt + output ids for a client that re-sends its history."""
        if self.tokens is not None and ids:
            text = await self.tokenizing.run(decode_exact, self.tokenizer, ids)
            await self.tokens.remember(tenant, text, ids)

    @property
    def limit(self) -> int:
        return min(self.engine.max_model_len, self.engine.capacity_tokens)

    async def fit(
        self, tenant: str, resp_id: str, req: ResponseRequest, ctx: TurnContext, specs: list[ToolSpec]
    ) -> Fitted:
        """The prompt of a turn (see the module docstring).

        Raises:
            InvalidParam: a foreign compaction item in the input (`input[i].encrypted_content`).
        """
        threshold = self._threshold(req)
        everything = [*ctx.history, *req.input_items]
        found = {}
        if threshold is not None or any(isinstance(it, Compaction) for it in everything):
            found = payloads(await self.store.compaction_secret(), ctx.history, req.input_items)
        summary, items = view(everything, found)

        async def render(summary: str | None, items: list[Item]) -> Prompt:
            if images_of(items):
                return await self._render_images(summary, items, req, ctx, specs)
            messages = with_summary(to_messages(items, req.body.instructions), summary, req.body.instructions)
            if ctx.previous_ids is None and self.tokens is not None:  # a re-sent history: its ids cached?
                text = await self.tokenizing.run(render_text, self.tokenizer, messages, specs, thinking=req.thinking)
                previous = await self._cached_ids(tenant, text)
                found: Prompt = await self.tokenizing.run(build_prompt, self.tokenizer, text, previous)
                return found

            def run() -> Prompt:
                text = render_text(self.tokenizer, messages, specs, thinking=req.thinking)
                return build_prompt(self.tokenizer, text, ctx.previous_ids)

            prompt: Prompt = await self.tokenizing.run(run)
            return prompt

        prompt = await render(summary, items)
        made: Compaction | None = None
        if threshold is not None and len(prompt.ids) > threshold:
            b = boundary(items)
            short, prompt = await self._shorten(items, b, ctx, summary, threshold, render)
            if len(prompt.ids) > threshold and b > 0:
                summary, _ = await self.summarise(tenant, f"{resp_id}_summary", summary, short[:b])
                secret = await self.store.compaction_secret()
                made = Compaction(id=new_id("cmp"), encrypted_content=sign(secret, Payload(summary, items[b].id)))
                items = items[b:]
                prompt = await render(summary, items)
        if req.body.truncation == "auto":
            want = req.body.max_output_tokens or 1
            while len(prompt.ids) + want > self.limit:
                fewer = drop_oldest_turn(items)
                if fewer is None:
                    break
                items = fewer
                prompt = await render(summary, items)
        return Fitted(prompt, made)

    async def _render_images(
        self, summary: str | None, items: list[Item], req: ResponseRequest, ctx: TurnContext, specs: list[ToolSpec]
    ) -> Prompt:
        """A context holding image parts: its markers become the images' runs (`sessions.image_prompt`)."""
        if self.images is None or self.processor is None:
            assert self.images is not None, "image parts reach a fitter without an image reader"
            i, j, _ = images_of(items)[0]
            raise self.images.refuse_all(f"input[{i}].content[{j}]", "input_image")
        pictures = await self.images.pictures(items, "context")
        marker = self.processor.marker
        messages = with_summary(to_messages(items, req.body.instructions, marker), summary, req.body.instructions)

        def run() -> Prompt:
            text = render_text(self.tokenizer, messages, specs, thinking=req.thinking)
            return image_prompt(self.processor, self.tokenizer, text, pictures, ctx.previous_ids)

        prompt: Prompt = await self.tokenizing.run(run)
        return prompt

    async def _shorten(
        self, items: list[Item], b: int, ctx: TurnContext, summary: str | None, threshold: int, render: Any
    ) -> tuple[list[Item], Prompt]:
        """Tool outputs shortened (step 1 of the module docstring of `sessions.compaction`): first
        only those the previous turn's prompt had shortened, if the prompt then fits and continues
        the previous one; else every one before `b`."""
        if ctx.previous_ids:
            head = await self.tokenizing.run(decode_exact, self.tokenizer, ctx.previous_ids)
            before = shortened_in(head, items[:b])
            if before:
                again = shorten(items, b, only=before)
                prompt: Prompt = await render(summary, again)
                if len(prompt.ids) <= threshold and prompt.reused:
                    return again, prompt
        short = shorten(items, b)
        return short, await render(summary, short)

    def _threshold(self, req: ResponseRequest) -> int | None:
        """The request's `compact_threshold`; 80% of the context limit when it names none."""
        for entry in req.body.context_management or []:
            if entry.get("type") == "compaction":
                value = entry.get("compact_threshold")
                return int(value) if value is not None else int(self.limit * 0.8)
        return None

    async def summarise(
        self, tenant: str, request_id: str, summary: str | None, older: list[Item]
    ) -> tuple[str, tuple[int, int]]:
        """The model's greedy summary of `older` (after an earlier `summary`), and its (prompt,
        output) token counts. The engine request runs at priority 1."""
        messages = summary_messages(summary, to_messages(older))
        text = await self.tokenizing.run(render_text, self.tokenizer, messages, [])
        ids = await self.tokenizing.run(encode, self.tokenizer, text)
        params = SamplingParams(priority=1, temperature=0.0, max_tokens=SUMMARY_MAX_TOKENS)
        handle = self.engine.add_request(ids, params, request_id=request_id, cache_salt=tenant)
        parts: list[str] = []
        produced = 0
        finished = False
        try:
            async for out in handle:
                parts.append(out.text_delta)
                produced += len(out.token_ids)
                if out.finish_reason is not None:
                    finished = True
                    if out.finish_reason == FinishReason.ERROR:
                        raise SummaryFailed(out.error or "the summary request failed")
        finally:
            if not finished:
                handle.abort()
        return "".join(parts), (len(ids), produced)

    async def compact(self, tenant: str, req: ResponseRequest, ctx: TurnContext) -> dict[str, Any]:
        """`POST /v1/responses/compact`: the context as a compaction item (summarising what is
        older than the second-last user message; empty when nothing is) followed by the items
        kept verbatim."""
        everything = [*ctx.history, *req.input_items]
        secret = await self.store.compaction_secret()
        summary, items = view(everything, payloads(secret, ctx.history, req.input_items))
        b = boundary(items)
        counts = (0, 0)
        if b > 0:
            summary, counts = await self.summarise(tenant, new_id("cmp"), summary, shorten(items, b)[:b])
            items = items[b:]
        # Always a compaction item first (an empty summary when nothing was old enough to
        # summarise), so that a client's next turn starts a new chain from it.
        made = Compaction(id=new_id("cmp"), encrypted_content=sign(secret, Payload(summary or "", None)))
        output: list[Item] = [made, *items]
        usage = {
            "input_tokens": counts[0],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts[1],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts[0] + counts[1],
        }
        return {
            "id": new_id("resp"),
            "object": "response.compaction",
            "created_at": now(),
            "output": output,
            "usage": usage,
        }
