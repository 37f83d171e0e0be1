"""`longctx route` in front of two real replicas on one Redis, through the `openai` client:
a conversation's turns and a `previous_response_id` chain stay on one replica (affinity, every
answer names its replica in `x-longctx-replica`) with their prompts cached; streams pass
through; a 429 from the affine replica is retried once on the other; a SIGKILLed replica leaves
the rotation within 5 s and its conversation goes on elsewhere, its KV read from Redis.

A second router started with `--replicas-from-redis` (no `--replica`) finds the replicas in the
registry they publish, sends a conversation it never saw to the replica that published it,
sends a keyless chat whose prompt begins like an earlier one's to the replica that served that
one (published prefix fingerprints), drops the killed replica within 5 s, and a replica that
stops withdraws its entry."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import redis

from api.router import registry
from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.router_process import router_metrics, start_router, wait_router
from tests.server import TEST_KEY, keys_args, start_server

ARGS = ("--dtype", "float32", "--threads", "1", "--kv-cache-bytes", "64MiB", "--background-workers", "0",
        "--served-model-name", "demo", "--max-queued-per-tenant", "1")  # fmt: skip
NOTES = " ".join(f"Note {i}: the hive number {i} gave {i % 7 + 3} kilos of honey." for i in range(25))


def test_router_affinity_retry_and_failover(demo_gguf: Path, tmp_path: Path) -> None:
    prefix = unique_prefix()
    with shared_redis() as (url, _):
        args = ("--redis-url", url, "--kv-redis-url", url, *ARGS, *keys_args(tmp_path))
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start_server, demo_gguf, *args, log=tmp_path / f"{n}.log", prefix=prefix)
                        for n in "ab"]  # fmt: skip
            servers = [f.result() for f in starting]
        base, router = start_router(*[x for s in servers for x in ("--replica", s.url)])
        base2, router2 = start_router("--replicas-from-redis", "--redis-url", url, "--redis-prefix", prefix)
        state = redis.Redis.from_url(url)
        try:
            wait_router(base, router, 2)
            wait_router(base2, router2, 2)  # both found in the registry
            client = openai.OpenAI(base_url=base + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)

            def turn(**kw: Any) -> tuple[str, openai.types.responses.Response]:
                raw = client.responses.with_raw_response.create(model="demo", temperature=0, max_output_tokens=6, **kw)  # type: ignore[arg-type]
                return raw.headers["x-longctx-replica"], raw.parse()

            conv = client.conversations.create(items=[])
            where, cached = set(), []
            for i, q in enumerate([NOTES + " Which hive gave most?", "And the least?", "Sum them."]):
                replica, r = turn(conversation=conv.id, input=q)
                where.add(replica)
                assert r.usage is not None
                if i:
                    cached.append(r.usage.input_tokens_details.cached_tokens / r.usage.input_tokens)
            assert len(where) == 1 and min(cached) >= 0.8, (where, cached)
            home = where.pop()

            # the second router never saw this conversation: the replica published it
            t0 = time.monotonic()
            while router_metrics(base2)[("longctx_router_published_keys", home)] < 1:
                assert time.monotonic() - t0 < 10
                time.sleep(0.1)
            client2 = openai.OpenAI(base_url=base2 + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)
            raw = client2.responses.with_raw_response.create(model="demo", conversation=conv.id, input="More?",
                                                             max_output_tokens=4, temperature=0)  # fmt: skip
            assert raw.headers["x-longctx-replica"] == home
            assert router_metrics(base2)[("longctx_router_affinity_hits_total", "")] == 1
            entry = state.get(registry.entry_key(prefix, home))
            assert entry is not None and TEST_KEY.encode() not in entry and conv.id.encode() not in entry

            # keyless chats whose prompts begin alike go where the first one went, through either router
            def chat(c: openai.OpenAI, q: str) -> tuple[str, int]:
                raw = c.chat.completions.with_raw_response.create(
                    model="demo", max_tokens=4, temperature=0,
                    messages=[{"role": "system", "content": NOTES}, {"role": "user", "content": q}],
                )  # fmt: skip
                usage = raw.parse().usage
                assert usage is not None and usage.prompt_tokens_details is not None
                return raw.headers["x-longctx-replica"], usage.prompt_tokens_details.cached_tokens or 0

            first, _ = chat(client, "Which hive gave least?")
            again, hit = chat(client, "Which hive gave six kilos?")
            assert again == first and hit > 0 and router_metrics(base)[("longctx_router_prefix_hits_total", "")] == 1
            t0 = time.monotonic()
            while router_metrics(base2)[("longctx_router_published_prefixes", first)] < 1:
                assert time.monotonic() - t0 < 10
                time.sleep(0.1)
            third, _ = chat(client2, "Which hive gave nine kilos?")
            assert third == first and router_metrics(base2)[("longctx_router_prefix_hits_total", "")] == 1

            chain, prev = set(), None
            for q in [NOTES + " Name a colour.", "Another one.", "A third."]:
                replica, r = turn(input=q, previous_response_id=prev)
                chain.add(replica)
                prev = r.id
            assert len(chain) == 1
            chain_home = chain.pop()

            events = list(client.responses.create(model="demo", conversation=conv.id, input="Bye.", stream=True,
                                                  max_output_tokens=6, temperature=0))  # fmt: skip
            assert events[0].type == "response.created" and events[-1].type in (
                "response.completed",
                "response.incomplete",
            )

            # two long prompts at once on the affine replica of a prompt_cache_key: its tenant may
            # hold one waiting request, so the other is a 429 there, retried on the other replica
            turn(input="Hi.", prompt_cache_key="k1")
            long_q = [" ".join(f"Item {i}-{n}: {i * n} apples." for i in range(80)) for n in range(2)]
            got: list[str] = []
            threads = [threading.Thread(target=lambda q=q: got.append(turn(input=q, prompt_cache_key="k1")[0]))
                       for q in long_q]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            m = router_metrics(base)
            assert m[("longctx_router_retried_429_total", "")] >= 1 and len(set(got)) == 2, (m, got)
            assert m[("longctx_router_affinity_hits_total", "")] >= 5

            # a stream on the chain's replica, which is killed once the stream has begun: the
            # stream ends with the router's error event, the replica leaves both routers' rotation
            # within 5 s, and the chain goes on on the other replica, its KV read from Redis
            dying = next(s for s in servers if s.url == chain_home)
            other = next(s for s in servers if s is not dying)
            body = {"model": "demo", "previous_response_id": prev, "input": "Count from 1 to 100.", "stream": True,
                    "max_output_tokens": 64, "temperature": 0}  # fmt: skip
            names = []
            with httpx.stream("POST", base + "/v1/responses", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {TEST_KEY}"}) as stream:  # fmt: skip
                assert stream.headers["x-longctx-replica"] == chain_home
                for line in stream.iter_lines():
                    if line.startswith("event: "):
                        names.append(line.removeprefix("event: "))
                        if names[-1] == "response.created":
                            dying.proc.send_signal(signal.SIGKILL)
                            t0 = time.monotonic()
                    elif line.startswith("data: ") and names[-1] == "error":
                        assert json.loads(line.removeprefix("data: "))["code"] == "replica_failed"
            assert names[0] == "response.created" and names[-1] == "error", names
            dying.proc.wait()
            for b in (base, base2):
                while router_metrics(b)[("longctx_router_replica_up", chain_home)] != 0:
                    assert time.monotonic() - t0 < 5
                    time.sleep(0.1)
            replica, r = turn(previous_response_id=prev, input="Still there?")
            assert replica == other.url and r.usage is not None
            assert r.usage.input_tokens_details.cached_tokens >= 0.8 * r.usage.input_tokens

            # the router's own routes are open, as a replica's are; /v1 is the replica's to refuse
            assert httpx.get(base + "/metrics").status_code == 200 and httpx.get(base + "/ready").status_code == 200
            refused = httpx.post(base + "/v1/responses", json={"model": "demo", "input": "Hi."}, timeout=30)
            assert refused.status_code == 401 and refused.headers["x-longctx-replica"] == other.url
            other.stop()  # a clean stop withdraws the entry at once
            assert state.zscore(registry.set_key(prefix), other.url) is None
            assert state.get(registry.entry_key(prefix, other.url)) is None
        finally:
            for proc in (router, router2):
                proc.terminate()
                proc.wait(10)
            for s in servers:
                if s.proc.poll() is None:
                    s.stop()
            state.close()
            delete_prefix(url, prefix)
