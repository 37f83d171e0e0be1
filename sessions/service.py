"""The Responses API over the session store and the engine: `SessionService`.

`create` runs a request in three steps:
1. checks: the body (`sessions.requests`), the Idempotency-Key, the conversation's lease (one
   running response per conversation: ConversationBusy), the context and its backfill
   (`sessions.context`), the prompt (`sessions.render`, off the event loop), the output grammar
   (`GrammarCompiler.for_request`, off the event loop), the output length. A failure here undoes
   the lease and the key and writes nothing else.
2. the engine request, read by a `Turn` (`sessions.turn`) into items and events;
3. the commit, once, then the terminal event.
A foreground response is returned whole, or as an `EventStream` when the request streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from engine.loading.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.surface import EngineSurface
from sessions.config import ServiceConfig
from sessions.context import load_context
from sessions.conversation_api import ConversationAPI, check_page
from sessions.errors import Conflict, ContextLengthExceeded, NotFound, RequestInProgress, StoreError, check_model
from sessions.event_stream import EventStream, replay, stored_events
from sessions.events import Event, EventWriter
from sessions.ids import new_id
from sessions.items import Item, Reasoning
from sessions.models import now
from sessions.output import OutputAssembler
from sessions.prompt_fit import PromptFitter
from sessions.reasoning import ReasoningSplitter, opens_in_reasoning, uses_reasoning
from sessions.recovery import settle
from sessions.requests import CreateResponseBody, InvalidParam, ResponseRequest, decode_request, sampling_params
from sessions.sealed import Sealer, open_reasoning
from sessions.store import SessionStore
from sessions.token_cache import TokenCache
from sessions.turn import Turn, TurnPlan
from sessions.waiting import WaitingGate, WaitingPlace
from tools.calls import ToolCallParser
from tools.constraints import parse_output_format
from tools.formats import ToolCallFormat, needs_special_tokens
from tools.grammar import GrammarCompiler
from tools.schema import HOSTED_TOOLS, ToolSpec, parse_tools

log = logging.getLogger("longctx.sessions")


class SessionService:
    """Responses over one engine and one store.

    Args:
        tool_format: how the model writes calls (`tools.formats.detect_format`).
    """

    def __init__(
        self,
        engine: EngineSurface,
        store: SessionStore,
        tokenizer: Tokenizer,
        compiler: GrammarCompiler,
        tool_format: ToolCallFormat,
        config: ServiceConfig | None = None,
    ):
        self.engine, self.store, self.tokenizer, self.compiler = engine, store, tokenizer, compiler
        self.tool_format = tool_format
        self.config = config or ServiceConfig()
        self.reasoning = uses_reasoning(tokenizer.chat_template)
        self.waiting: WaitingGate | None = None  # the server's per-tenant count of waiting requests
        # a call marker that is a special token (Mistral's) must reach the call parser
        self.keep_special = needs_special_tokens(tool_format, tokenizer)
        self.running: dict[str, Turn] = {}
        self._hosted_seen: set[str] = set()
        self.conversations = ConversationAPI(store)
        self.fitter = PromptFitter(engine, store, tokenizer, TokenCache(store.client, store.config.prefix))

    # ---- create ----

    async def create(
        self,
        tenant: str,
        request: ResponseRequest | CreateResponseBody | bytes | dict[str, Any],
        idempotency_key: str | None = None,
        history: list[Item] | None = None,
    ) -> Any:
        """Run a response: the final `Response`, or an `EventStream` of its events when it streams.

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
        undo = _Undo(self.store, tenant)
        turn: Turn | None = None
        if idempotency_key is not None and req.store:
            first = await undo.bind(idempotency_key, _slot_of(req))
            if first is not None:
                return await self._repeat(tenant, first, req.stream)
        try:
            try:
                plan = await self._plan(tenant, req, undo, history=history)
            except NotFound as e:
                e.param = _id_param(e, req)
                raise
            if req.background:
                return await self._enqueue(plan, undo, req.stream)
            turn = Turn(
                self.engine,
                self.store,
                plan,
                plan.assembler.writer,
                self.config.lease_renew_s,
                self.config.kv_commit_wait_s,
            )
            turn.waiting = WaitingPlace(self.waiting, tenant)  # the tenant's 429 before any write
            if plan.store:  # retrievable while it runs, `failed` if its server dies (`sessions.recovery`)
                if plan.conversation_id is None:
                    await self.store.responses.hold(plan.response.id)
                await self.store.responses.save(tenant, plan.response)
            turn.submit()
        except BaseException:
            if turn is not None:
                turn.waiting.release()
            await undo.run()
            raise
        return await self._start(turn, req.stream)

    async def _enqueue(self, plan: TurnPlan, undo: _Undo, stream: bool) -> Any:
        """A checked background request: stored `queued` with its input, then queued on the jobs
        stream; the worker (`sessions.tasks`) plans it again from what is stored."""
        if undo.lease is not None:  # the worker takes the lease when it runs the turn
            await self.store.conversations.release_lease(*undo.lease)
            undo.lease = None
        await self.store.responses.save(plan.tenant, plan.response, plan.input_items)
        await self.store.jobs.enqueue(plan.response.id, plan.tenant)
        return self.stream_events(plan.tenant, plan.response.id) if stream else plan.response

    async def _plan(
        self, tenant: str, req: ResponseRequest, undo: _Undo, priority: int = 0, history: list[Item] | None = None
    ) -> TurnPlan:
        """Every check of step 1 (see the module docstring), and what the turn needs."""
        specs = self._tools(req)
        resp_id = undo.resp_id or new_id("resp", like=_slot_of(req))
        fence = None
        if req.conversation_id is not None:
            fence = await self.store.conversations.acquire_lease(tenant, req.conversation_id, resp_id)
            undo.lease = (req.conversation_id, resp_id, fence)
        seal = "reasoning.encrypted_content" in (req.body.include or [])
        sealer = None
        if seal or any(isinstance(i, Reasoning) and isinstance(i.encrypted_content, str) for i in req.input_items):
            sealer = Sealer(await self.store.reasoning_key(), tenant)
            open_reasoning(req.input_items, sealer)
        ctx = await load_context(self.store, tenant, req, history)
        keep = asyncio.create_task(self._keep_lease(undo.lease)) if undo.lease is not None else None
        try:  # a summary request can outlast the lease
            prompt, compaction = await self.fitter.fit(tenant, resp_id, req, ctx, specs)
        finally:
            if keep is not None:
                keep.cancel()
        max_tokens = self._max_tokens(len(prompt.ids), req.body.max_output_tokens)
        response = req.response(self.config.model, max_tokens)
        response.id = resp_id
        grammar = await asyncio.to_thread(self._grammar, req, specs)
        params = self._params(req, max_tokens, priority)
        writer = EventWriter()
        parser = ToolCallParser(self.tool_format, specs) if specs and req.tool_choice != "none" else None
        splitter = ReasoningSplitter(self.reasoning, self.reasoning and opens_in_reasoning(prompt.text))
        assembler = OutputAssembler(writer, parser, splitter)
        if seal and sealer is not None:
            assembler.seal = sealer.seal
        if compaction is not None:  # the first output item; `Turn.run` emits its events
            assembler.items.append(compaction)
        matcher = grammar and self.compiler.matcher(grammar)
        forced: tuple[list[int], str] = ([], "")
        if matcher is not None and not assembler.in_reasoning and not params.logprobs:
            forced = await self.fitter.tokenizing.run(_forced, matcher, self.tokenizer, params)

        async def remember(ids: list[int]) -> None:
            await self.fitter.remember(tenant, ids)

        return TurnPlan(
            tenant, response, req.input_items, prompt.ids, params, matcher, assembler, req.store,
            req.conversation_id, fence, ctx.base_version, *forced, remember=remember,
        )  # fmt: skip

    async def _keep_lease(self, lease: tuple[str, str, int]) -> None:
        while True:
            await asyncio.sleep(self.config.lease_renew_s)
            try:
                await self.store.conversations.renew_lease(*lease)
            except StoreError as e:  # LeaseLost shows at the commit
                log.warning("lease renewal of %s failed: %s", lease[0], e)

    async def _start(self, turn: Turn, stream: bool) -> Any:
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
            turn.waiting.release()

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
        (once, reason `server_shutdown`); waits up to `timeout_s` for those commits. Background
        turns are left to their workers (`sessions.tasks`), which hand their jobs back. Returns
        how many turns were stopped."""
        turns = [t for t in self.running.values() if not t.plan.response.background]
        for turn in turns:
            turn.stop("shutdown")
        tasks = [t.task for t in turns if t.task is not None and not t.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return len(turns)

    async def _repeat(self, tenant: str, first: str, stream: bool) -> Any:
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

    # ---- the checks ----

    def _tools(self, req: ResponseRequest) -> list[ToolSpec]:
        """The tools the model is offered; hosted ones by `--hosted-tools` (ignored: logged once a type)."""
        try:
            specs = parse_tools(req.body.tools or [], hosted=self.config.hosted_tools)
        except ValueError as e:
            raise InvalidParam(_param(e, req, "tools"), str(e)) from None
        for t in req.tools:
            kind = t.get("type")
            if kind in HOSTED_TOOLS and kind not in self._hosted_seen:
                self._hosted_seen.add(kind)
                log.info("hosted tool type %r is not offered to the model (--hosted-tools ignore)", kind)
        return specs

    def _grammar(self, req: ResponseRequest, specs: list[ToolSpec]) -> Any:
        tools = specs if req.tool_choice != "none" else []
        if req.response_format() is None and not tools:
            return None
        fmt = (req.body.text or {}).get("format")
        try:
            return self.compiler.for_request(
                parse_output_format(fmt, "text.format"), tools, req.body.tool_choice,
                req.body.parallel_tool_calls is not False and req.body.max_tool_calls != 1, self.tool_format,
            )  # fmt: skip
        except ValueError as e:
            raise InvalidParam(_param(e, req, "text.format" if fmt else "tools"), str(e)) from None

    def _max_tokens(self, prompt_len: int, asked: int | None) -> int:
        """min(context left, KV capacity left, the cap) by default; InvalidParam past the cap or
        when the prompt leaves no room (code context_length_exceeded, both numbers)."""
        limit = min(self.engine.max_model_len, self.engine.capacity_tokens)
        cap = self.config.max_output_tokens
        if asked is not None and asked > cap:
            raise InvalidParam("max_output_tokens", f"at most {cap} on this server, got {asked}")
        want = asked if asked is not None else 1
        if prompt_len + want > limit:
            raise ContextLengthExceeded(
                "input", f"the context is {prompt_len} tokens and asks for {want} more; the limit is {limit} tokens"
            )
        return asked if asked is not None else min(limit - prompt_len, cap)

    def _params(self, req: ResponseRequest, max_tokens: int, priority: int = 0) -> SamplingParams:
        b = req.body
        return sampling_params(
            {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
            priority=priority,  # background: 1
            skip_special_tokens=not (self.keep_special and bool(req.tools)),
            max_tokens=max_tokens,
            temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p,
            presence_penalty=b.presence_penalty or 0.0,
            frequency_penalty=b.frequency_penalty or 0.0,
            seed=b.seed,
            logprobs=b.top_logprobs or None,
        )

    # ---- other response operations ----

    async def retrieve(self, tenant: str, resp_id: str) -> Any:
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
    ) -> Any:
        check_page(limit, order)
        return await self.store.responses.list_input_items(tenant, resp_id, after, limit, order)  # type: ignore[arg-type]

    def stream_events(self, tenant: str, resp_id: str, starting_after: int | None = None) -> AsyncIterator[Event]:
        """A background response's stored events after `starting_after`, live until its last one."""
        return stored_events(self.store, tenant, resp_id, starting_after)

    async def cancel(self, tenant: str, resp_id: str) -> Any:
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


def _param(e: Exception, req: ResponseRequest, default: str) -> str:
    """The request field a tools/ error is about: its own `param`, else the tool its message names."""
    param = getattr(e, "param", None)
    if isinstance(param, str) and param:  # tools/ was given the Chat shape; the client sent the flat one
        param = param.replace("].function.", "].", 1).replace("].function", "]", 1)
        return param.replace("response_format.json_schema", "text.format").replace("response_format", "text.format")
    for i, t in enumerate(req.tools):
        if f"'{t.get('name')}'" in str(e):
            return f"tools[{i}].parameters"
    return default


def _slot_of(req: ResponseRequest) -> str | None:
    """The id whose slot tag a new response shares (`sessions.ids`): its conversation's, or its
    previous response's (so a whole chain lies in one Redis Cluster slot)."""
    return req.conversation_id or req.body.previous_response_id


class _Undo:
    """What step 1 of `create` took and gives back when a later check fails."""

    def __init__(self, store: SessionStore, tenant: str):
        self.store, self.tenant = store, tenant
        self.key: tuple[str, str] | None = None
        self.resp_id: str | None = None
        self.lease: tuple[str, str, int] | None = None

    async def bind(self, key: str, like: str | None = None) -> str | None:
        resp_id = new_id("resp", like=like)
        first = await self.store.remember_idempotency(self.tenant, key, resp_id)
        if first is None:
            self.key, self.resp_id = (key, resp_id), resp_id
        return first

    async def run(self) -> None:
        if self.lease is not None:
            await self.store.conversations.release_lease(*self.lease)
        if self.key is not None:
            await self.store.forget_idempotency(self.tenant, *self.key)


def _forced(matcher: Any, tokenizer: Tokenizer, params: SamplingParams) -> tuple[list[int], str]:
    """The reply's forced first tokens (`XGrammarMatcher.forced_prefix`) and their text as the
    engine would stream it."""
    ids: list[int] = matcher.forced_prefix(tokenizer, params.max_tokens - 1)
    return ids, tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens) if ids else ""
