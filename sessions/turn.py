"""One response run on the engine: prepared (`TurnPlan`), generated, committed once.

`Turn.run` adds the engine request (id = the response id, cache salt = the tenant), reads it with
`async for`, turns its text into items and events (`sessions.output`), renews the conversation's
lease every `renew_s` while it runs, then writes the final response exactly once:

    conversation   commit_turn: input + output items appended, response written, lease released
                   (a failed or cancelled turn appends nothing)
    otherwise      responses.save with its input items and token ids (`previous_response_id`)
    store: false   nothing

and only then emits the terminal event, so a client that saw it can retrieve the response.
Finish reasons map to statuses: STOP -> completed, LENGTH -> incomplete (max_output_tokens),
ERROR -> failed, ABORT -> incomplete (the client left, or the server stopped: reason
`server_shutdown`) or cancelled (`cancel`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from engine.request import FinishReason, RequestHandle
from engine.sampling_params import SamplingParams
from engine.surface import EngineSurface
from sessions.errors import Conflict, LeaseLost, StoreError
from sessions.events import EventWriter
from sessions.items import Item
from sessions.models import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    Response,
    ResponseError,
    Usage,
    now,
)
from sessions.output import OutputAssembler
from sessions.store import SessionStore
from sessions.waiting import WaitingPlace

log = logging.getLogger("longctx.sessions")

StopWhy = Literal["client_disconnected", "cancelled", "lease_lost", "shutdown"]


@dataclass
class TurnPlan:
    """Everything checked and computed before the engine call.

    Attributes:
        response: the response as it starts (`in_progress`), echoing the request.
        input_items: the request's input items (written with the turn).
        prompt_ids: the whole prompt; `base_version`/`fence`: the conversation's, if any.
        forced_ids: the reply's first tokens when the grammar allows only them (a required
            call's marker and name): prefilled with the prompt, yet output of the turn.
    """

    tenant: str
    response: Response
    input_items: list[Item]
    prompt_ids: list[int]
    params: SamplingParams
    matcher: Any
    assembler: OutputAssembler
    store: bool
    conversation_id: str | None = None
    fence: int | None = None
    base_version: int | None = None
    forced_ids: list[int] = field(default_factory=list)
    forced_text: str = ""
    # called with prompt + output ids after a turn that produced output (`sessions.token_cache`)
    remember: Callable[[list[int]], Awaitable[None]] | None = None


class Turn:
    """Runs one `TurnPlan` (see the module docstring); `stop` ends it early from any task."""

    def __init__(
        self,
        engine: EngineSurface,
        store: SessionStore,
        plan: TurnPlan,
        writer: EventWriter,
        renew_s: float = 10,
        kv_wait_s: float = 0.05,
    ):
        self.engine, self.store, self.plan, self.writer, self.renew_s = engine, store, plan, writer, renew_s
        self.kv_wait_s = kv_wait_s  # the commit waits this long for the turn's KV pages (`kv_commit_wait`)
        self.handle: RequestHandle | None = None
        self.stopped: StopWhy | None = None
        self.result: Response | None = None
        self.task: asyncio.Task[Response] | None = None  # set by whoever runs it as a task
        self.waiting = WaitingPlace(None, plan.tenant)  # its tenant's waiting place, until its first output

    @property
    def id(self) -> str:
        return self.plan.response.id

    def stop(self, why: StopWhy) -> None:
        """End the generation (the engine request is aborted); the turn still commits once."""
        if self.stopped is None:
            self.stopped = why
        if self.handle is not None:
            self.handle.abort()

    def submit(self) -> None:
        """Add the engine request (raises the engine's overload or context errors, nothing started)."""
        p = self.plan
        params = p.params
        if p.forced_ids:
            params = replace(params, max_tokens=params.max_tokens - len(p.forced_ids))
        self.handle = self.engine.add_request(
            p.prompt_ids + p.forced_ids, params, request_id=p.response.id, cache_salt=p.tenant, matcher=p.matcher
        )

    async def run(self) -> Response:
        p = self.plan
        if self.handle is None:
            self.submit()
        handle = self.handle
        assert handle is not None
        if self.stopped is not None:
            handle.abort()
        await self.writer.snapshot("response.created", p.response)
        await self.writer.snapshot("response.in_progress", p.response)
        for i, item in enumerate(p.assembler.items):  # made before generation (a compaction item)
            await self.writer.item_added(i, item)
            await self.writer.item_done(i, item)
        renew = asyncio.create_task(self._renew()) if p.fence is not None or self._holds_response() else None
        output_ids: list[int] = list(p.forced_ids)
        reasoning_tokens = cached = 0
        if p.forced_text:
            await p.assembler.feed(p.forced_text)
        reason: FinishReason | None = None
        error: str | None = None
        try:
            async for out in handle:
                self.waiting.release()
                if p.assembler.in_reasoning:
                    reasoning_tokens += len(out.token_ids)
                output_ids += out.token_ids
                cached = min(out.cached_tokens, len(p.prompt_ids))
                if out.text_delta:
                    await p.assembler.feed(out.text_delta)
                if out.finish_reason is not None:
                    reason, error = out.finish_reason, out.error
        finally:
            self.waiting.release()
            if renew is not None:
                renew.cancel()
            if reason is None:  # we were cancelled: the engine must not run on
                handle.abort()
        status = self._status(reason)
        items = await p.assembler.finish("completed" if status == "completed" else "incomplete")
        usage = Usage(
            input_tokens=len(p.prompt_ids),
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=len(output_ids),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=len(p.prompt_ids) + len(output_ids),
        )
        final = msgspec.structs.replace(
            p.response, status=status, output=list(items), usage=usage, completed_at=now(),
            incomplete_details=self._incomplete(status, reason),
            error=ResponseError("server_error", error or "generation failed") if status == "failed" else None,
        )  # fmt: skip
        final = await self._commit(final, output_ids)
        if p.remember is not None and final.status in ("completed", "incomplete") and output_ids:
            await p.remember([*p.prompt_ids, *output_ids])
        self.result = final
        await self.writer.terminal(final)
        return final

    def _status(self, reason: FinishReason | None) -> Literal["completed", "incomplete", "failed", "cancelled"]:
        if self.stopped == "lease_lost" or reason == FinishReason.ERROR or reason is None:
            return "failed"
        if self.stopped == "cancelled":
            return "cancelled"
        if reason == FinishReason.STOP:
            return "completed"
        return "incomplete"  # LENGTH, or ABORT when the client left

    def _incomplete(self, status: str, reason: FinishReason | None) -> IncompleteDetails | None:
        if status != "incomplete":
            return None
        if reason == FinishReason.LENGTH:
            return IncompleteDetails("max_output_tokens")
        return IncompleteDetails("server_shutdown" if self.stopped == "shutdown" else "client_disconnected")

    async def _commit(self, final: Response, output_ids: list[int]) -> Response:
        p = self.plan
        if not p.store:
            return final
        store = getattr(self.engine, "store", None)
        if self.kv_wait_s > 0 and getattr(store, "redis", None) is not None:  # the next turn may run elsewhere
            await asyncio.to_thread(self.engine.kv_commit_wait, self.kv_wait_s)
        try:
            if p.conversation_id is not None:
                assert p.fence is not None
                await self.store.conversations.commit_turn(
                    p.tenant, p.conversation_id, p.fence, final, p.input_items, base_version=p.base_version,
                    prompt_ids=p.prompt_ids, output_ids=output_ids, append=final.status not in ("failed", "cancelled"),
                )  # fmt: skip
            else:
                await self.store.responses.save(
                    p.tenant, final, p.input_items, prompt_ids=p.prompt_ids, output_ids=output_ids
                )
                if self._holds_response():
                    await self._release_response()
        except (LeaseLost, Conflict) as e:
            await self._release()
            if self.stopped == "cancelled" and isinstance(e, Conflict):  # cancelled (and written) elsewhere
                return msgspec.structs.replace(final, status="cancelled", incomplete_details=None)
            log.warning("response %s was not committed: %s", final.id, e)
            return msgspec.structs.replace(final, status="failed", error=ResponseError("conflict", str(e)))
        except BaseException:
            await self._release()
            raise
        return final

    async def _release(self) -> None:
        p = self.plan
        if p.conversation_id is not None and p.fence is not None:
            try:  # after a failed commit the lease is still ours
                await self.store.conversations.release_lease(p.conversation_id, p.response.id, p.fence)
            except StoreError:
                log.warning("could not release the lease of %s; it expires by itself", p.conversation_id)

    async def _release_response(self) -> None:
        try:
            await self.store.responses.release(self.plan.response.id)
        except StoreError:
            log.warning("could not drop the lease of %s; it expires by itself", self.plan.response.id)

    def _holds_response(self) -> bool:
        """A stored foreground response outside a conversation: its `hold` is renewed as it runs."""
        p = self.plan
        return p.store and p.conversation_id is None and not p.response.background

    async def _renew(self) -> None:
        p = self.plan
        while True:
            await asyncio.sleep(self.renew_s)
            if p.fence is None:
                try:
                    await self.store.responses.hold(p.response.id)
                except StoreError as e:  # transient: the mark outlives two missed renewals
                    log.warning("renewal of %s failed: %s", p.response.id, e)
                continue
            assert p.conversation_id is not None
            try:
                await self.store.conversations.renew_lease(p.conversation_id, p.response.id, p.fence)
            except LeaseLost:
                log.warning("response %s lost its conversation lease", p.response.id)
                self.stop("lease_lost")
                return
            except StoreError as e:  # transient: the lease outlives two missed renewals
                log.warning("lease renewal of %s failed: %s", p.conversation_id, e)
