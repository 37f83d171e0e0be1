"""One response run on the engine: prepared (`TurnPlan`), generated, committed once.

`Turn.run` adds the engine request and reads it (`sessions.generation.Generation`, as a Chat
Completions reply is read), turns its text into items and events (`sessions.output`), renews the
conversation's lease every `lease_renew_s` while it runs, then writes the final response exactly once:

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
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from engine.request import FinishReason
from engine.surface import EngineSurface
from sessions.config import ServiceConfig
from sessions.errors import Conflict, LeaseLost, StoreError
from sessions.events import EventWriter
from sessions.generation import Generation
from sessions.items import Item
from sessions.models import IncompleteDetails, Response, ResponseError, now
from sessions.output import OutputAssembler
from sessions.store import SessionStore

log = logging.getLogger("longctx.sessions")

StopWhy = Literal["client_disconnected", "cancelled", "lease_lost", "shutdown"]


@dataclass(kw_only=True)
class TurnPlan:
    """Everything checked and computed before the engine call.

    Attributes:
        response: the response as it starts (`in_progress`), echoing the request.
        input_items: the request's input items (written with the turn).
        generation: the engine request, its prompt and the reply's readers (`sessions.generation`).
        assembler: the reply's items and events, over the generation's readers.
        conversation_id, fence, base_version: the conversation's, if any.
        remember: called with prompt + output ids after a turn that produced output
            (`sessions.token_cache`).
    """

    response: Response
    input_items: list[Item]
    generation: Generation
    assembler: OutputAssembler
    store: bool
    conversation_id: str | None = None
    fence: int | None = None
    base_version: int | None = None
    remember: Callable[[list[int]], Awaitable[None]] | None = None

    @property
    def tenant(self) -> str:
        return self.generation.tenant

    @property
    def prompt_ids(self) -> list[int]:
        return self.generation.prompt.ids


class Turn:
    """Runs one `TurnPlan` (see the module docstring); `stop` ends it early from any task.

    Args:
        config: how often the conversation's lease is renewed (`lease_renew_s`) and how long the
            commit waits for the turn's KV pages (`kv_commit_wait_s`).
    """

    def __init__(self, engine: EngineSurface, store: SessionStore, plan: TurnPlan, config: ServiceConfig):
        self.engine, self.store, self.plan, self.config = engine, store, plan, config
        self.stopped: StopWhy | None = None
        self.result: Response | None = None
        self.task: asyncio.Task[Response] | None = None  # set by whoever runs it as a task

    @property
    def id(self) -> str:
        return self.plan.response.id

    @property
    def writer(self) -> EventWriter:
        return self.plan.assembler.writer

    def stop(self, why: StopWhy) -> None:
        """End the generation (the engine request is aborted); the turn still commits once."""
        if self.stopped is None:
            self.stopped = why
        self.plan.generation.abort()

    def submit(self) -> None:
        """Add the engine request (raises the engine's overload or context errors, nothing started)."""
        self.plan.generation.submit(self.engine)

    async def run(self) -> Response:
        p, gen = self.plan, self.plan.generation
        if gen.handle is None:
            self.submit()
        if self.stopped is not None:
            gen.abort()
        await self.writer.snapshot("response.created", p.response)
        await self.writer.snapshot("response.in_progress", p.response)
        for i, item in enumerate(p.assembler.items):  # made before generation (a compaction item)
            await self.writer.item_added(i, item)
            await self.writer.item_done(i, item)
        renew = asyncio.create_task(self._renew()) if p.fence is not None or self._holds_response() else None
        try:
            async with contextlib.aclosing(gen.read(p.assembler)) as outputs:
                async for _ in outputs:
                    pass
        finally:
            if renew is not None:
                renew.cancel()
        status = self._status(gen.reason)
        items = await p.assembler.finish("completed" if status == "completed" else "incomplete")
        final = msgspec.structs.replace(
            p.response,
            status=status,
            output=list(items),
            usage=gen.usage(),
            completed_at=now(),
            incomplete_details=self._incomplete(status, gen.reason),
            error=ResponseError("server_error", gen.error or "generation failed") if status == "failed" else None,
        )
        final = await self._commit(final, gen.output_ids)
        if p.remember is not None and final.status in ("completed", "incomplete") and gen.output_ids:
            await p.remember([*p.prompt_ids, *gen.output_ids])
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
        wait_s = self.config.kv_commit_wait_s
        if wait_s > 0 and getattr(store, "redis", None) is not None:  # the next turn may run elsewhere
            await asyncio.to_thread(self.engine.kv_commit_wait, wait_s)
        try:
            if p.conversation_id is not None:
                assert p.fence is not None
                await self.store.conversations.commit_turn(
                    p.tenant,
                    p.conversation_id,
                    p.fence,
                    final,
                    p.input_items,
                    base_version=p.base_version,
                    prompt_ids=p.prompt_ids,
                    output_ids=output_ids,
                    append=final.status not in ("failed", "cancelled"),
                )
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
            await asyncio.sleep(self.config.lease_renew_s)
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
