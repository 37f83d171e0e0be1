"""Background responses: workers that run the jobs `SessionService.create` queued on `P:jobs`.

Each process runs `workers` loops that claim new jobs (XREADGROUP) and one loop that takes over
jobs idle longer than `claim_idle_s` (their server died; XAUTOCLAIM), at start and every
`heartbeat_s`. A running job heartbeats every `heartbeat_s`. A job is run from what is committed:
the stored `queued` response (its parameters) and its input items, planned again (the context may
have changed), at engine priority 1; its events go to the response's event stream, numbered on
after any a dead attempt left, each with `"attempt": n` from the second attempt on. An engine
overload or a busy conversation makes the worker back off and retry, never fail the job. A
response that is final (done, or cancelled while queued) is acked and skipped; one cancelled
while it runs elsewhere is noticed within `CANCEL_POLL_S`.

Stopping (the server shuts down): `stop_claiming` first (no new job is taken; one claimed
meanwhile is handed straight back), `drain` lets running jobs finish until a deadline, then
cancelling `run` aborts the rest without a commit and hands their jobs back to the queue
(`JobQueue.requeue`), so another server's worker runs them at once, as a next attempt.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from engine.request import EngineOverloaded
from sessions.config import WorkerConfig
from sessions.errors import ConversationBusy, NotFound, StoreError
from sessions.events import EventWriter
from sessions.items import Item
from sessions.models import Response
from sessions.requests import CreateResponseBody, ResponseRequest
from sessions.service import SessionService
from sessions.streams import Job
from sessions.turn import Turn
from sessions.undo import Undo

log = logging.getLogger("longctx.sessions")
CANCEL_POLL_S = 0.5


def request_of(response: Response, items: list[Item]) -> ResponseRequest:
    """The request a stored response was made by (its echoed parameters) with its input items."""
    b = CreateResponseBody(
        model=response.model,
        instructions=response.instructions,
        temperature=response.temperature,
        top_p=response.top_p,
        presence_penalty=response.presence_penalty,
        frequency_penalty=response.frequency_penalty,
        max_output_tokens=response.max_output_tokens,
        max_tool_calls=response.max_tool_calls,
        previous_response_id=response.previous_response_id,
        parallel_tool_calls=response.parallel_tool_calls,
        store=True,
        background=True,
        truncation=response.truncation,
        prompt_cache_key=response.prompt_cache_key,
        metadata=response.metadata,
        reasoning=response.reasoning,
        top_logprobs=response.top_logprobs or None,
        service_tier=response.service_tier,
        safety_identifier=response.safety_identifier,
    )
    conv = response.conversation.id if response.conversation else None
    return ResponseRequest(
        b, items, tools=list(response.tools), tool_choice=response.tool_choice, text=response.text, conversation_id=conv
    )


class BackgroundWorkers:
    """The background loops of one process (see the module docstring); `run` until cancelled."""

    def __init__(self, service: SessionService, config: WorkerConfig | None = None, name: str | None = None):
        config = config or WorkerConfig()
        self.service, self.store, self.workers = service, service.store, config.workers
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.heartbeat_s, self.claim_idle_s = config.heartbeat, config.claim_idle_s
        self._tasks: set[asyncio.Task[Any]] = set()
        self._turns: dict[str, asyncio.Task[Response]] = {}  # response id -> its running turn
        self._jobs: dict[str, Job] = {}  # job id -> job being run here and not yet acked
        self.claiming = True

    def stop_claiming(self) -> None:
        """Take no new job (any thread, or a signal handler: it only sets a flag)."""
        self.claiming = False

    async def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the jobs running here to finish."""
        turns = list(self._turns.values())
        if turns and timeout_s > 0:
            await asyncio.wait(turns, timeout=timeout_s)

    async def run(self) -> None:
        """Claim and run jobs until cancelled; then running turns are aborted without a commit,
        so that their jobs stay pending and another server reruns them."""
        loops = [self._claim_new(f"{self.name}-{i}") for i in range(self.workers)]
        try:
            await asyncio.gather(*loops, self._claim_stale(f"{self.name}-stale"))
        finally:
            turns = list(self._turns.values())
            for t in [*self._tasks, *turns]:
                t.cancel()
            await asyncio.gather(*self._tasks, *turns, return_exceptions=True)
            await self._hand_back(list(self._jobs.values()))

    async def _hand_back(self, jobs: list[Job]) -> None:
        """Queue unfinished jobs again; a job whose response is already final (stopped between
        its commit and its ack) is acked instead, so no worker claims it again."""
        for job in jobs:
            try:
                if await self._is_final(job):
                    await self.store.jobs.ack(job.id)
                else:
                    await self.store.jobs.requeue(job)
                    log.info("background response %s handed back to the queue", job.response_id)
            except StoreError as e:  # left pending: taken over once idle for claim_idle_s
                log.warning("could not hand back background job %s: %s", job.response_id, e)
            self._jobs.pop(job.id, None)

    async def _is_final(self, job: Job) -> bool:
        try:
            return (await self.store.responses.get(job.tenant, job.response_id)).terminal
        except NotFound:  # deleted meanwhile: nothing to run
            return True

    async def _claim_new(self, consumer: str) -> None:
        while self.claiming:
            try:
                jobs = await self.store.jobs.claim(consumer, count=1, block_ms=2000)
            except StoreError as e:
                log.warning("claiming background jobs failed: %s", e)
                await asyncio.sleep(1)
                continue
            if not self.claiming:  # claimed while stopping: another server runs it
                await self._hand_back(jobs)
                return
            for job in jobs:
                try:
                    await self.run_job(consumer, job)
                except StoreError as e:  # the ack: the job is rerun (its response is final: skipped)
                    log.warning("background job %s not acknowledged: %s", job.response_id, e)

    async def _claim_stale(self, consumer: str) -> None:
        while self.claiming:
            try:
                jobs = await self.store.jobs.autoclaim_stale(consumer, int(self.claim_idle_s * 1000))
            except StoreError as e:
                log.warning("taking over stale background jobs failed: %s", e)
                jobs = []
            if not self.claiming:
                await self._hand_back(jobs)
                return
            for job in jobs:
                if job.response_id in self._turns:  # ours, running: its heartbeat was late
                    continue
                log.info("taking over background response %s", job.response_id)
                task = asyncio.create_task(self.run_job(consumer, job))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self.heartbeat_s)

    async def run_job(self, consumer: str, job: Job) -> Response | None:
        """Run one job to its end (backing off while the engine is overloaded), then ack it. A job
        that fails otherwise (Redis unavailable, ...) is left pending: its heartbeat stops, and
        it is taken over and rerun once idle for `claim_idle_s`."""
        beat = asyncio.create_task(self._heartbeat(consumer, job))
        backoff = 0.5
        self._jobs[job.id] = job  # until acked or left pending; a cancelled run is handed back
        try:
            while True:
                try:
                    final = await self._run(job)
                    break
                except (EngineOverloaded, ConversationBusy) as e:
                    wait = max(backoff, e.retry_after_s if isinstance(e, EngineOverloaded) else 0.0)
                    log.info("background response %s waits %.1f s: %s", job.response_id, wait, e)
                    await asyncio.sleep(wait)
                    backoff = min(2 * backoff, 10.0)
                except NotFound:
                    final = None  # deleted meanwhile
                    break
                except Exception:
                    log.exception("background response %s failed; it stays queued for a rerun", job.response_id)
                    self._jobs.pop(job.id, None)
                    return None
        finally:
            beat.cancel()
        self._jobs.pop(job.id, None)
        await self.store.jobs.ack(job.id)
        return final

    async def _heartbeat(self, consumer: str, job: Job) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                if not await self.store.jobs.heartbeat(consumer, job.id):
                    log.warning("background job %s was taken over by another worker", job.response_id)
                    turn = self.service.running.get(job.response_id)
                    if turn is not None:
                        turn.stop("lease_lost")
                    return
            except StoreError as e:
                log.warning("heartbeat of %s failed: %s", job.response_id, e)

    async def _run(self, job: Job) -> Response:
        svc, tenant, resp_id = self.service, job.tenant, job.response_id
        stored = await self.store.responses.get(tenant, resp_id)
        if stored.terminal:
            return stored
        page = await self.store.responses.list_input_items(tenant, resp_id, limit=100, order="asc")
        items = page.items
        while page.has_more:
            page = await self.store.responses.list_input_items(tenant, resp_id, page.last_id, 100, "asc")
            items += page.items
        seen = [e async for e in _all_events(svc, tenant, resp_id)]
        undo = Undo(self.store, tenant)
        undo.resp_id = resp_id
        try:
            plan = await svc.planner.plan(tenant, request_of(stored, items), undo, priority=1)
            plan.response.status, plan.response.created_at = "in_progress", stored.created_at
            attempt = {"attempt": 2} if seen else {}  # a rerun after a dead worker's attempt
            writer = EventWriter(self.store_sink(resp_id), first=seen[-1] + 1 if seen else 0, extra=attempt)
            plan.assembler.writer = writer
            turn = Turn(svc.engine, self.store, plan, svc.config)
            await self.store.responses.save(tenant, plan.response)  # retrieved `in_progress` while it runs
            turn.submit()
        except BaseException:
            await undo.run()
            raise
        svc.running[resp_id] = turn
        turn.task = task = self._turns[resp_id] = asyncio.create_task(turn.run())
        watch = asyncio.create_task(self._watch_cancel(tenant, turn))
        try:
            final = await asyncio.shield(task)
        finally:
            watch.cancel()
            svc.running.pop(resp_id, None)
            self._turns.pop(resp_id, None)
        await self.store.events.finish(resp_id)
        return final

    def store_sink(self, resp_id: str) -> Any:
        async def sink(event: dict[str, Any]) -> None:
            await self.store.events.append(resp_id, event)

        return sink

    async def _watch_cancel(self, tenant: str, turn: Turn) -> None:
        """Stop the turn once the stored response is final (cancelled by another server)."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            try:
                if (await self.store.responses.get(tenant, turn.id)).terminal:
                    turn.stop("cancelled")
                    return
            except StoreError:
                pass


async def _all_events(svc: SessionService, tenant: str, resp_id: str) -> Any:
    """Sequence numbers of the events already stored for a response."""
    last = None
    while True:
        batch = await svc.store.events.read(tenant, resp_id, last, count=1000)
        for e in batch:
            yield e.seq
        if len(batch) < 1000:
            return
        last = batch[-1].seq
