"""The Responses API over the session store and the engine: `SessionService`.

`create` runs a request in three steps:
1. checks: the body (`sessions.requests`), the Idempotency-Key, then `sessions.planning`: the
   conversation's lease (one running response per conversation: ConversationBusy), the context
   and its backfill (`sessions.context`), the prompt (`sessions.render`, off the event loop), and
   the generation (`sessions.generation`: the output grammar off the event loop, the output
   length). A failure here undoes the lease and the key and writes nothing else.
2. the engine request, read by a `Turn` (`sessions.turn`) into items and events;
3. the commit, once, then the terminal event.
A foreground response is returned whole, or as its events (`ResponseEvents`) when the request
streams.

`stateless` is the same turn without a conversation or stored items: Chat Completions' (`api.chat`).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

import msgspec

from engine.loading.tokenizer import Tokenizer
from engine.surface import EngineSurface
from sessions.config import ServiceConfig
from sessions.context import load_context
from sessions.conversation_api import ConversationAPI, check_page
from sessions.errors import Conflict, NotFound, RequestInProgress, check_model
from sessions.event_stream import EventStream, ResponseEvents, replay, stored_events
from sessions.events import Event, EventWriter
from sessions.generation import Generation, Generations, ReplyAsk
from sessions.image_parts import ImageParts
from sessions.image_prompt import image_prompt
from sessions.items import Item, ItemPage
from sessions.models import Response, now
from sessions.planning import TurnPlanner
from sessions.prompt_fit import PromptFitter
from sessions.recovery import settle
from sessions.render import Prompt, render_messages, render_text
from sessions.requests import CreateResponseBody, InvalidParam, ResponseRequest, decode_request
from sessions.store import SessionStore
from sessions.token_cache import TokenCache
from sessions.turn import Turn, TurnPlan
from sessions.undo import Undo
from sessions.waiting import WaitingGate, WaitingPlace
from tools.formats import ToolCallFormat
from tools.grammar import GrammarCompiler

log = logging.getLogger("longctx.sessions")


class SessionService:
    """Responses over one engine and one store.

    Args:
        tool_format: how the model writes calls (`tools.formats.detect_format`).
        image_processor: a vision-language checkpoint's `engine.loading.images.ImageProcessor`
            (None: a model without image input, which refuses image parts).
    """

    def __init__(
        self,
        engine: EngineSurface,
        store: SessionStore,
        tokenizer: Tokenizer,
        compiler: GrammarCompiler,
        tool_format: ToolCallFormat,
        config: ServiceConfig | None = None,
        image_processor: Any = None,
    ):
        self.engine, self.store, self.tokenizer, self.compiler = engine, store, tokenizer, compiler
        self.tool_format = tool_format
        self.config = config = config or ServiceConfig()
        self.waiting: WaitingGate | None = None  # the server's per-tenant count of waiting requests
        self.running: dict[str, Turn] = {}
        self.stateless_running: weakref.WeakSet[Generation] = weakref.WeakSet()  # Chat Completions
        self.conversations = ConversationAPI(store)
        self.fitter = PromptFitter(engine, store, tokenizer, TokenCache(store.client, store.config.prefix))
        marker = image_processor.marker if image_processor is not None else None
        self.images = self.fitter.images = ImageParts(config.images, marker, config.model)
        self.fitter.processor = image_processor
        self.conversations.images = self.images
        self.generations = Generations(engine, tokenizer, compiler, tool_format, config, self.fitter.tokenizing)
        self.planner = TurnPlanner(store, self.fitter, self.generations, config)

    # ---- create ----

    async def create(
        self,
        tenant: str,
        request: ResponseRequest | CreateResponseBody | bytes | dict[str, Any],
        idempotency_key: str | None = None,
        history: list[Item] | None = None,
    ) -> Response | ResponseEvents:
        """Run a response: the final `Response`, or its events when it streams.

        `history`: the items of the `previous_response_id` chain, given by a WebSocket connection
        that holds them for a response that was not stored (`api.ws`).

        Raises (before any write or engine call): InvalidParam (400), NotFound (404),
        ConversationBusy and RequestInProgress (409), StoreUnavailable (503).
        """
        req = request if isinstance(request, ResponseRequest) else decode_request(request)
        check_model(req.body.model, self.config.model, required=False)
        if req.body.temperature is None:  # the server's defaults (`--override-generation-config`)
            req.body.temperature = self.config.temperature
        if req.body.top_p is None:
            req.body.top_p = self.config.top_p
        undo = Undo(self.store, tenant)
        plan: TurnPlan | None = None
        if idempotency_key is not None and req.store:
            first = await undo.bind(idempotency_key, req.slot_of)
            if first is not None:
                return await self._repeat(tenant, first, req.stream)
        try:
            try:
                plan = await self.planner.plan(tenant, req, undo, history=history)
            except NotFound as e:
                e.param = _id_param(e, req)
                raise
            if req.background:
                return await self._enqueue(plan, undo, req.stream)
            turn = Turn(self.engine, self.store, plan, self.config)
            plan.generation.waiting = WaitingPlace(self.waiting, tenant)  # the tenant's 429 before any write
            if plan.store:  # retrievable while it runs, `failed` if its server dies (`sessions.recovery`)
                if plan.conversation_id is None:
                    await self.store.responses.hold(plan.response.id)
                await self.store.responses.save(tenant, plan.response)
            turn.submit()
        except BaseException:
            if plan is not None:
                plan.generation.release()
            await undo.run()
            raise
        return await self._start(turn, req.stream)

    async def stateless(
        self, tenant: str, request_id: str, messages: list[dict[str, Any]], ask: ReplyAsk
    ) -> Generation:
        """A turn without a conversation or stored items (Chat Completions): `messages` rendered
        with the offered tools, planned as a response's generation is, and submitted, holding the
        tenant's waiting place. Read it with `Generation.read`; leaving that early aborts it.

        Raises (before any engine call): InvalidParam (ContextLengthExceeded), tools'
        InvalidRequest, the tenant's or the engine's overload (429).
        """
        messages, pictures = await self.images.chat_messages(messages)
        if pictures:
            tok, processor = self.tokenizer, self.fitter.processor

            def run() -> Prompt:
                text = render_text(tok, messages, ask.offered)
                return image_prompt(processor, tok, text, pictures, None, param="messages")

            prompt = await self.fitter.tokenizing.run(run)
        else:
            prompt = await self.fitter.tokenizing.run(render_messages, self.tokenizer, messages, ask.offered)
        generation = await self.generations.plan(ask, prompt, request_id=request_id, tenant=tenant)
        generation.waiting = WaitingPlace(self.waiting, tenant)
        try:
            generation.submit(self.engine)
        except BaseException:
            generation.release()
            raise
        self.stateless_running.add(generation)
        return generation

    async def _enqueue(self, plan: TurnPlan, undo: Undo, stream: bool) -> Response | ResponseEvents:
        """A checked background request: stored `queued` with its input, then queued on the jobs
        stream; the worker (`sessions.tasks`) plans it again from what is stored."""
        if undo.lease is not None:  # the worker takes the lease when it runs the turn
            await self.store.conversations.release_lease(*undo.lease)
            undo.lease = None
        await self.store.responses.save(plan.tenant, plan.response, plan.input_items)
        await self.store.jobs.enqueue(plan.response.id, plan.tenant)
        return self.stream_events(plan.tenant, plan.response.id) if stream else plan.response

    async def _start(self, turn: Turn, stream: bool) -> Response | ResponseEvents:
        """The turn runs as its own task, so that a caller who leaves (a cancelled request, a closed
        stream) stops the generation but never the commit."""
        self.running[turn.id] = turn
        events = EventStream(turn)
        if stream:
            turn.writer.sink = events.sink
        task = turn.task = events.start().task
        assert task is not None

        def done(_: object) -> None:  # also a task cancelled before it ran
            self.running.pop(turn.id, None)
            turn.plan.generation.release()

        task.add_done_callback(done)
        if stream:
            return events
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            turn.stop("client_disconnected")
            raise

    async def stop_foreground(self, timeout_s: float) -> int:
        """The server stops: every foreground turn running here is stopped and commits `incomplete`
        (once, reason `server_shutdown`), and every stateless one (Chat Completions) is aborted, so
        that its stream ends with a finish reason; waits up to `timeout_s` for those commits. Background
        turns are left to their workers (`sessions.tasks`), which hand their jobs back. Returns
        how many turns were stopped."""
        turns = [t for t in self.running.values() if not t.plan.response.background]
        for turn in turns:
            turn.stop("shutdown")
        for generation in list(self.stateless_running):  # their readers end with the engine's last output
            if generation.handle is not None and not generation.handle.done:
                generation.abort()
        tasks = [t.task for t in turns if t.task is not None and not t.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return len(turns)

    async def _repeat(self, tenant: str, first: str, stream: bool) -> Response | ResponseEvents:
        """An Idempotency-Key repeat: the first response once final (409 while it runs)."""
        if first in self.running:
            raise RequestInProgress(first)
        try:
            response = await self.store.responses.get(tenant, first)
        except NotFound:
            raise RequestInProgress(first) from None
        response = await settle(self.store, tenant, response, running=False)  # its server may have died
        if not response.terminal:
            raise RequestInProgress(first)
        if not stream:
            return response
        writer, events = EventWriter(), []

        async def keep(event: Event) -> None:
            events.append(event)

        writer.sink = keep
        await writer.snapshot("response.created", response)
        await writer.terminal(response)
        return replay(events)

    # ---- other response operations ----

    async def retrieve(self, tenant: str, resp_id: str) -> Response:
        """The stored response (NotFound if none); `failed` if its server died (`sessions.recovery`)."""
        response = await self.store.responses.get(tenant, resp_id)
        return await settle(self.store, tenant, response, resp_id in self.running)

    async def compact(self, tenant: str, request: CreateResponseBody | bytes | dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/responses/compact` (`sessions.prompt_fit.PromptFitter.compact`); writes nothing."""
        req = decode_request(request)
        check_model(req.body.model, self.config.model)
        return await self.fitter.compact(tenant, req, await load_context(self.store, tenant, req))

    async def delete(self, tenant: str, resp_id: str) -> dict[str, Any]:
        await self.store.responses.delete(tenant, resp_id)
        return {"id": resp_id, "object": "response.deleted", "deleted": True}

    async def input_items(
        self, tenant: str, resp_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> ItemPage:
        check_page(limit, order)
        return await self.store.responses.list_input_items(tenant, resp_id, after, limit, order)  # type: ignore[arg-type]

    def stream_events(self, tenant: str, resp_id: str, starting_after: int | None = None) -> ResponseEvents:
        """A background response's stored events after `starting_after`, live until its last one."""
        return stored_events(self.store, tenant, resp_id, starting_after)

    async def cancel(self, tenant: str, resp_id: str) -> Response:
        """Cancel a background response (InvalidParam for a foreground one); a final one is returned
        as it is. Running here, its turn stops and commits `cancelled`; queued or running on another
        server, it is written `cancelled` (final: nothing overwrites it), which that server's worker
        notices within `CANCEL_POLL_S` and stops."""
        response = await self.store.responses.get(tenant, resp_id)
        if not response.background:
            raise InvalidParam("response_id", "only background responses can be cancelled")
        if response.terminal:
            return response
        turn = self.running.get(resp_id)
        if turn is not None and turn.task is not None:
            turn.stop("cancelled")
            return await asyncio.shield(turn.task)
        cancelled = msgspec.structs.replace(response, status="cancelled", completed_at=now())
        try:
            await self.store.responses.save(tenant, cancelled)
        except Conflict:  # it became final meanwhile
            return await self.store.responses.get(tenant, resp_id)
        return cancelled


def _id_param(e: NotFound, req: ResponseRequest) -> str | None:
    """The request field naming the id that was not found (None: neither)."""
    if e.kind == "conversation" and e.id == req.conversation_id:
        return "conversation"
    if e.kind == "response" and e.id == req.body.previous_response_id:
        return "previous_response_id"
    return None
