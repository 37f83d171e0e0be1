"""Turns, SIGKILLs and restarts over two real `longctx serve` processes on one Redis, in orders
hypothesis picks: a turn of conversation j on replica i (refused while i is down), a background
turn (queued there; a job of a killed replica is taken over by the other's worker), a kill of
replica i in the middle of a streamed turn (only while the other replica is up, so one always
answers), and a restart of replica i. The replicas have short leases and job claim idle times,
and live across examples: an example restarts only what it killed.

After each example, through the API of a live replica: every turn answered 200 has its items in
its conversation exactly once, in the order the turns were answered, and nothing else is
there; a turn cut by a kill, and a background turn, is there exactly once when its response
ends completed or incomplete and not at all when it ends failed (a cut turn does once its lease
expired), a background turn anywhere among the others (it commits when it ends); each
conversation's version (in Redis) never went back and went up with every turn answered 200."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import redis
from hypothesis import Phase, event, example, given, settings
from hypothesis import strategies as st

from sessions.keys import Keys
from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.server import TEST_KEY, Server, demo_args, keys_args, start_server

LEASE_MS = 2000
CLAIM_IDLE_S = 2
ARGS = (*demo_args("64MiB", 1), "--threads", "1", "--lease-ttl-ms", str(LEASE_MS),
        "--job-claim-idle-s", str(CLAIM_IDLE_S))  # fmt: skip
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 1), st.integers(0, 1)),
        st.tuples(st.just("turn"), st.integers(0, 1), st.integers(0, 1)),
        st.tuples(st.just("background"), st.integers(0, 1), st.integers(0, 1)),
        st.tuples(st.just("kill"), st.integers(0, 1), st.integers(0, 1)),
        st.tuples(st.just("restart"), st.integers(0, 1), st.just(0)),
    ),
    min_size=2,
    max_size=6,
)


@dataclass
class Replicas:
    """The two replicas (None: killed), started on one Redis under one prefix."""

    model: Path
    url: str
    prefix: str
    args: tuple[str, ...]
    logs: Path
    servers: list[Server | None] = field(default_factory=lambda: [None, None])
    starts: int = 0

    def start(self, i: int) -> None:
        self.starts += 1
        log = self.logs / f"{i}-{self.starts}.log"
        self.servers[i] = start_server(self.model, "--redis-url", self.url, *self.args, log=log, prefix=self.prefix)

    def client(self, i: int) -> openai.OpenAI | None:
        s = self.servers[i]
        if s is None:
            return None
        return openai.OpenAI(base_url=s.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)

    def live(self) -> openai.OpenAI:
        return next(c for c in (self.client(0), self.client(1)) if c is not None)


@pytest.fixture(scope="module")
def replicas(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    logs = tmp_path_factory.mktemp("kill-random")
    with shared_redis() as (url, _):
        pool = Replicas(demo_gguf, url, unique_prefix(), (*ARGS, *keys_args(logs)), logs)
        try:
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(pool.start, (0, 1)))
            yield pool
        finally:
            for s in pool.servers:
                if s is not None and s.proc.poll() is None:
                    s.stop()
            delete_prefix(url, pool.prefix)


@dataclass
class Turn:
    text: str  # its input message, unique
    answered: bool  # 200; else cut by a kill or background (its outcome read from its response)
    response: str | None
    outputs: list[str]  # the output item ids of an answered turn
    background: bool = False


def _turn(client: openai.OpenAI, conv: str, text: str) -> Turn | None:
    """A turn answered 200 (completed or incomplete), or None (refused, busy, failed)."""
    try:
        r = client.responses.create(model="demo", conversation=conv, input=text, max_output_tokens=3, temperature=0)
    except (openai.APIStatusError, openai.APIConnectionError):
        return None
    if r.status not in ("completed", "incomplete"):
        return None
    return Turn(text, True, r.id, [item.id for item in r.output if item.id is not None])


def _background(client: openai.OpenAI, conv: str, text: str) -> Turn | None:
    try:
        r = client.responses.create(model="demo", conversation=conv, input=text, max_output_tokens=3,
                                    temperature=0, background=True)  # fmt: skip
    except (openai.APIStatusError, openai.APIConnectionError):
        return None
    return Turn(text, False, r.id, [], background=True)


def _killed_turn(pool: Replicas, i: int, conv: str, text: str) -> Turn | None:
    """A streamed turn on replica i, which is SIGKILLed once the turn has begun."""
    client, server = pool.client(i), pool.servers[i]
    assert client is not None and server is not None
    response = None
    try:
        with client.responses.stream(model="demo", conversation=conv, input=text, max_output_tokens=200,
                                     temperature=0) as events:  # fmt: skip
            for event in events:
                if event.type == "response.created":
                    response = event.response.id
                    server.proc.send_signal(signal.SIGKILL)
                    break
    except (openai.APIError, httpx.HTTPError):
        pass  # busy (409) before it began, or cut by the kill
    if server.proc.poll() is None:  # it never began: kill anyway
        server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    pool.servers[i] = None
    return Turn(text, False, response, []) if response is not None else None


def _settled(client: openai.OpenAI, response: str) -> tuple[str, list[str]]:
    """A cut or background turn's response once it ended (a cut one's lease expired; a job of a
    killed replica taken over): its status and output item ids."""
    deadline = time.monotonic() + LEASE_MS / 1000 + CLAIM_IDLE_S + 60
    while True:
        r = client.responses.retrieve(response)
        if r.status not in ("in_progress", "queued") or time.monotonic() > deadline:
            return str(r.status), [item.id for item in r.output if item.id is not None]
        time.sleep(0.2)


def _check(client: openai.OpenAI, conv: str, turns: list[Turn]) -> None:
    kept = []
    for t in turns:  # first every cut or background turn's end, then the items
        if not t.answered:
            assert t.response is not None
            status, t.outputs = _settled(client, t.response)
            event(f"a {'background' if t.background else 'cut'} turn ended {status}")
            assert status in ("completed", "incomplete", "failed"), status
            if status == "failed":
                continue
        kept.append(t)
    items = list(client.conversations.items.list(conv, order="asc", limit=100))
    ids = [item.id for item in items]
    assert len(ids) == len(set(ids)), ids
    groups: list[tuple[str, list[str]]] = []  # (user text, ids of the items after it)
    for item in items:
        data = item.model_dump()
        if data.get("type") == "message" and data.get("role") == "user":
            groups.append(("".join(p.get("text", "") for p in data["content"]), []))
        else:
            assert groups, f"an item before any input: {data}"
            groups[-1][1].append(data["id"])
    background = {t.text for t in turns if t.background}
    in_order = [t.text for t in kept if not t.background]
    assert [text for text, _ in groups if text not in background] == in_order, (groups, kept)
    texts = [text for text, _ in groups]
    assert sorted(texts) == sorted(t.text for t in kept), (groups, kept)  # each once
    outputs = dict(groups)
    for t in kept:
        assert outputs[t.text] == t.outputs, (outputs[t.text], t)


# no shrinking: each example costs real server starts; a failure prints its steps as they were
@settings(max_examples=5, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@example(steps=[("turn", 0, 0), ("background", 0, 1), ("kill", 0, 0), ("turn", 1, 0), ("restart", 0, 0),
                ("turn", 0, 0), ("turn", 1, 1)])  # fmt: skip
@given(steps=STEPS)
def test_no_committed_item_is_lost_or_duplicated(replicas: Replicas, steps: list[tuple[str, int, int]]) -> None:
    pool = replicas
    state = redis.Redis.from_url(pool.url)
    try:
        convs = [pool.live().conversations.create(items=[]).id for _ in range(2)]
        turns: list[list[Turn]] = [[], []]
        versions = [[0], [0]]
        for n, (op, i, j) in enumerate(steps):
            text = f"Turn {n} of conversation {j}."
            if op == "restart" and pool.servers[i] is None:
                pool.start(i)
                event("restarted")
            elif op == "kill" and pool.servers[i] is not None and pool.servers[1 - i] is not None:
                cut = _killed_turn(pool, i, convs[j], text)
                event("killed mid-turn" if cut is not None else "killed before the turn began")
                if cut is not None:
                    turns[j].append(cut)
            elif op == "background":
                client = pool.client(i)
                queued = _background(client, convs[j], text) if client is not None else None
                event("background turn queued" if queued is not None else "background turn refused")
                if queued is not None:
                    turns[j].append(queued)
            elif op == "turn":
                client = pool.client(i)
                done = _turn(client, convs[j], text) if client is not None else None
                event("turn answered" if done is not None else "turn refused (down, busy)")
                if done is not None:
                    turns[j].append(done)
            for c, conv in enumerate(convs):
                version = int(state.hget(Keys(pool.prefix).conv(conv), "version") or 0)
                assert version >= versions[c][-1], versions[c]
                if op == "turn" and c == j and turns[j] and turns[j][-1].text == text:
                    assert version > versions[c][-1], (versions[c], version)
                versions[c].append(version)
        for c, conv in enumerate(convs):
            _check(pool.live(), conv, turns[c])
    finally:
        state.close()
