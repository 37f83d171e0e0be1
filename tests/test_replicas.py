"""Two `longctx serve` replicas on one Redis (same `--redis-url`, `--kv-redis-url`, prefix), as a
client sees them through the `openai` client: a conversation's turns alternate between them and
each later turn finds >= 80% of its prompt cached (the KV pages the other replica wrote, which
the commit waited for: `--kv-commit-wait-ms`); a second turn on a conversation running on the
other replica is a 409 `conversation_busy`, and the items stay in order; a background response
whose replica is SIGKILLed is finished by the other (`--job-claim-idle-s`), its stream read there
with `starting_after` contiguous, each event once."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import openai
import pytest

from kvstore.redis_connect import cluster_enabled, connect
from sessions.keys import Keys
from sessions.streams import GROUP
from tests.redis_cluster import local_cluster
from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.server import TEST_KEY, Server, keys_args, start_server

CLAIM_IDLE_S = 3
ARGS = ("--dtype", "float32", "--threads", "1", "--kv-cache-bytes", "64MiB", "--background-workers", "1",
        "--served-model-name", "demo", "--job-claim-idle-s", str(CLAIM_IDLE_S))  # fmt: skip
NOTES = " ".join(f"Note {i}: the hive number {i} gave {i % 7 + 3} kilos of honey." for i in range(25))


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)


def _job_owner(url: str, prefix: str, resp_id: str, deadline_s: float = 60) -> str:
    """The consumer (`host-pid-i`) running the background response's job."""
    r = connect(url)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for entry in r.xpending_range(Keys(prefix).jobs, GROUP, "-", "+", 10):
            fields = cast(list[Any], r.xrange(Keys(prefix).jobs, entry["message_id"], entry["message_id"]))
            if fields and fields[0][1][b"resp"].decode() == resp_id:
                return str(cast(bytes, entry["consumer"]).decode())
        time.sleep(0.1)
    raise AssertionError("the background job was not claimed")


@pytest.fixture(params=["one-redis", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The shared test Redis, or a 3-master Redis Cluster (state and KV on it)."""
    if request.param == "one-redis":
        with shared_redis() as (url, _):
            yield url
    else:
        with local_cluster(3) as cluster:
            yield cluster.url


def test_two_replicas_share_conversations(demo_gguf: Path, tmp_path: Path, redis_url: str) -> None:
    prefix = unique_prefix()
    url = redis_url
    args = ("--redis-url", url, "--kv-redis-url", url, *ARGS, *keys_args(tmp_path))
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(start_server, demo_gguf, *args, log=tmp_path / f"{n}.log", prefix=prefix)
                    for n in "ab"]  # fmt: skip
        servers = [f.result() for f in starting]
    try:
        a, b = (_client(s) for s in servers)
        conv = a.conversations.create(items=[])
        cached = []
        for i, q in enumerate([NOTES + " Which hive gave most?", "And the least?", "Sum them.", "Thanks."]):
            client = (a, b)[i % 2]
            r = client.responses.create(model="demo", conversation=conv.id, input=q, temperature=0,
                                        max_output_tokens=8)  # fmt: skip
            assert r.status in ("completed", "incomplete") and r.usage is not None
            if i:
                cached.append(r.usage.input_tokens_details.cached_tokens / r.usage.input_tokens)
        assert min(cached) >= 0.8, cached

        # a turn running on a; the same conversation's turn on b meanwhile: 409
        stream = a.responses.create(model="demo", conversation=conv.id, input="Count to fifty.", temperature=0,
                                    max_output_tokens=60, stream=True)  # fmt: skip
        events = iter(stream)
        assert next(events).type == "response.created"
        with pytest.raises(openai.ConflictError) as busy:
            b.responses.create(model="demo", conversation=conv.id, input="Hello?", max_output_tokens=4)
        assert "conversation_busy" in str(busy.value.body)
        assert [e.type for e in events][-1] in ("response.completed", "response.incomplete")
        items = b.conversations.items.list(conv.id, order="asc", limit=100).data
        assert len(items) == 10 and [i.type for i in items[::2]] == ["message"] * 5

        # a background response whose replica dies is finished by the other
        job = a.responses.create(model="demo", input="Tell me a long story about bees.", background=True,
                                 temperature=0, max_output_tokens=80)  # fmt: skip
        owner = _job_owner(url, prefix, job.id)
        dying = next(s for s in servers if f"-{s.proc.pid}-" in owner)
        other = _client(next(s for s in servers if s is not dying))
        seen = []
        for event in other.responses.retrieve(job.id, stream=True):
            seen.append(event.sequence_number)
            if len(seen) >= 4:
                break
        dying.proc.send_signal(signal.SIGKILL)
        dying.proc.wait()
        resumed = [e.sequence_number for e in other.responses.retrieve(job.id, stream=True, starting_after=seen[-1])]
        numbers = [n for n in resumed if n is not None]
        assert numbers == list(range(seen[-1] + 1, seen[-1] + 1 + len(numbers))), numbers
        final = other.responses.retrieve(job.id)
        assert final.status in ("completed", "incomplete") and final.output_text
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop()
        if not cluster_enabled(url):
            delete_prefix(url, prefix)
