"""Step 1 of a Responses turn: every check, and what the turn needs (`sessions.turn.TurnPlan`).

`TurnPlanner.plan` takes the conversation's lease (one running response per conversation:
ConversationBusy), opens sealed reasoning, loads the context and its backfill
(`sessions.context`), fits the prompt (`sessions.prompt_fit`: compaction and truncation, renewing
the lease while a summary is written), plans the generation (`sessions.generation`: the output
limit, the grammar, the reply's readers, the sampling params, as a Chat Completions reply is
planned) and the reply's items and events (`sessions.output`). What it takes (the lease) is
recorded in the caller's `Undo`, given back if a later check fails; tools' errors are named by
the Responses API's flat fields.
"""

from __future__ import annotations

import asyncio
import logging

from sessions.config import ServiceConfig
from sessions.context import load_context
from sessions.errors import StoreError
from sessions.events import EventWriter
from sessions.generation import Generations, ReplyAsk
from sessions.ids import new_id
from sessions.items import Item, Reasoning
from sessions.output import OutputAssembler
from sessions.prompt_fit import PromptFitter
from sessions.requests import InvalidParam, ResponseRequest
from sessions.sealed import Sealer, open_reasoning
from sessions.store import SessionStore
from sessions.turn import TurnPlan
from sessions.undo import Undo
from tools.constraints import parse_output_format
from tools.schema import HOSTED_TOOLS, InvalidRequest, ToolSpec, parse_tools

log = logging.getLogger("longctx.sessions")


class TurnPlanner:
    def __init__(self, store: SessionStore, fitter: PromptFitter, generations: Generations, config: ServiceConfig):
        self.store, self.fitter, self.generations, self.config = store, fitter, generations, config
        self._hosted_seen: set[str] = set()

    async def plan(
        self, tenant: str, req: ResponseRequest, undo: Undo, priority: int = 0, history: list[Item] | None = None
    ) -> TurnPlan:
        """Every check of step 1 (see the module docstring), and what the turn needs.

        Args:
            priority: the engine's admission order (a background job's turn: 1).
            history: the items of the `previous_response_id` chain, held by a WebSocket
                connection for a response that was not stored (`api.ws`).
        """
        specs = self._tools(req)
        if self.fitter.images is not None:  # image parts read and checked before anything is taken
            await self.fitter.images.check_items(req.input_items)
        resp_id = undo.resp_id or new_id("resp", like=req.slot_of)
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
        fmt = (req.body.text or {}).get("format")
        try:
            ask = _ask(req, specs, priority, self.config)
            generation = await self.generations.plan(ask, prompt, request_id=resp_id, tenant=tenant)
        except InvalidRequest as e:
            raise InvalidParam(_param(e, req, "text.format" if fmt else "tools"), str(e)) from None
        response = req.response(self.config.model, generation.params.max_tokens)
        response.id = resp_id
        assembler = OutputAssembler(EventWriter(), generation.parser, generation.splitter)
        if seal and sealer is not None:
            assembler.seal = sealer.seal
        if compaction is not None:  # the first output item; `Turn.run` emits its events
            assembler.items.append(compaction)

        async def remember(ids: list[int]) -> None:
            await self.fitter.remember(tenant, ids)

        return TurnPlan(
            response=response,
            input_items=req.input_items,
            generation=generation,
            assembler=assembler,
            store=req.store,
            conversation_id=req.conversation_id,
            fence=fence,
            base_version=ctx.base_version,
            remember=remember,
        )

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

    async def _keep_lease(self, lease: tuple[str, str, int]) -> None:
        while True:
            await asyncio.sleep(self.config.lease_renew_s)
            try:
                await self.store.conversations.renew_lease(*lease)
            except StoreError as e:  # LeaseLost shows at the commit
                log.warning("lease renewal of %s failed: %s", lease[0], e)


def _ask(req: ResponseRequest, specs: list[ToolSpec], priority: int, config: ServiceConfig) -> ReplyAsk:
    """What a Responses request asks of its reply, in that API's field names."""
    b = req.body
    return ReplyAsk(
        tools=specs,
        tool_choice=b.tool_choice,
        parallel_tool_calls=b.parallel_tool_calls is not False and b.max_tool_calls != 1,
        output_format=parse_output_format((b.text or {}).get("format"), "text.format"),
        max_tokens=b.max_output_tokens,
        temperature=config.temperature if b.temperature is None else b.temperature,
        top_p=config.top_p if b.top_p is None else b.top_p,
        presence_penalty=b.presence_penalty or 0.0,
        frequency_penalty=b.frequency_penalty or 0.0,
        seed=b.seed,
        logprobs=b.top_logprobs or None,
        priority=priority,
    )


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
