"""A server killed (SIGKILL) in the middle of a foreground turn: on a new server on the same Redis,
the response reads `failed` once the conversation's lease expired, and the conversation's
items are as before. Its own server processes (demo model, float32, shared test Redis)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai

from kvstore.redis_connect import connect
from sessions.keys import Keys
from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.server import TEST_KEY, demo_args, keys_args, start_server

# Short leases and job claims, so that the next server takes over in seconds (30 by default).
LEASE_S = 5
CLAIM_IDLE_S = 3
ARGS = (*demo_args("64MiB", 0), "--lease-ttl-ms", str(LEASE_S * 1000))


def test_foreground_turn_of_a_killed_server_is_failed(demo_gguf: Path, tmp_path: Path) -> None:
    """Both kinds of foreground response: a conversation's turn (its conversation lease) and one
    on a `previous_response_id` chain (a lease of its own), killed together."""
    prefix = unique_prefix()
    with shared_redis() as (url, _):
        first = start_server(
            demo_gguf, "--redis-url", url, *ARGS, *keys_args(tmp_path), log=tmp_path / "a.log", prefix=prefix
        )
        second = None
        try:
            client = openai.OpenAI(base_url=first.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)
            conv = client.conversations.create(items=[{"role": "user", "content": "Hello"}])
            before = [i.id for i in client.conversations.items.list(conv.id).data]
            prev = client.responses.create(model="demo", input="Hello", max_output_tokens=4, temperature=0)
            runs: dict[str, Any] = {
                "conversation": {"conversation": conv.id},
                "chain": {"previous_response_id": prev.id},
            }
            seen: dict[str, str] = {}
            started = {name: threading.Event() for name in runs}
            killed = threading.Event()
            errors: dict[str, Exception] = {}  # raised before the kill

            def stream(name: str) -> None:
                try:
                    with client.responses.stream(model="demo", input="Tell me a long story.", temperature=0,
                                                 max_output_tokens=400, **runs[name]) as events:  # fmt: skip
                        for event in events:
                            if event.type == "response.created":
                                seen[name] = event.response.id
                            if event.type == "response.output_text.delta":
                                started[name].set()
                except Exception as e:  # after the kill: the server is gone under it
                    if not killed.is_set():
                        errors[name] = e
                    started[name].set()

            readers = [threading.Thread(target=stream, args=(name,), daemon=True) for name in runs]
            for reader in readers:
                reader.start()
            assert all(e.wait(120) for e in started.values()) and not errors and set(seen) == set(runs), errors
            assert client.responses.retrieve(seen["chain"]).status == "in_progress"  # alive: its lease renewed
            lease_ms = connect(url).pttl(Keys(prefix).resp_lease(seen["chain"]))
            assert 0 < lease_ms <= LEASE_S * 1000, lease_ms  # --lease-ttl-ms took
            killed.set()
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
            for reader in readers:
                reader.join(30)
            assert not errors, errors
            second = start_server(
                demo_gguf, "--redis-url", url, *ARGS, *keys_args(tmp_path), log=tmp_path / "b.log", prefix=prefix
            )
            client = openai.OpenAI(base_url=second.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)
            deadline = time.monotonic() + LEASE_S + 30
            for resp_id in seen.values():
                status = client.responses.retrieve(resp_id).status
                while status == "in_progress" and time.monotonic() < deadline:
                    time.sleep(0.5)
                    status = client.responses.retrieve(resp_id).status
                assert status == "failed"
                response = client.responses.retrieve(resp_id)
                assert response.error is not None and "stopped" in response.error.message
            assert [i.id for i in client.conversations.items.list(conv.id).data] == before
            assert client.responses.create(model="demo", conversation=conv.id, input="Hi", max_output_tokens=4).id
        finally:
            for server in (first, second):
                if server is not None and server.proc.poll() is None:
                    server.stop()
            delete_prefix(url, prefix)


def kv_pages(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return sum(1 for key in client.scan_iter(f"{prefix}:kv:*", count=1000) if not key.endswith(b":pending"))
    finally:
        client.close()


def test_background_and_kv_pages_survive_a_killed_server(demo_gguf: Path, tmp_path: Path) -> None:
    """A background response killed mid-generation is taken over and finished by the next server,
    and its events resume after N; the next turn of a ~3k-token conversation finds its KV pages in
    Redis (the state Redis here)."""
    args = (*demo_args("256MiB", 1), "--job-claim-idle-s", str(CLAIM_IDLE_S))
    prefix = unique_prefix()
    long_text = " ".join(f"Note {i}: the hive number {i} gave {i % 7 + 3} kilos of honey." for i in range(160))
    with shared_redis() as (url, _):
        first = start_server(
            demo_gguf, "--redis-url", url, *args, *keys_args(tmp_path), log=tmp_path / "a.log", prefix=prefix
        )
        second = None
        try:
            client = openai.OpenAI(base_url=first.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)
            conv = client.conversations.create(items=[])
            turn = client.responses.create(model="demo", conversation=conv.id, input=long_text + "\nThanks.",
                                           temperature=0, max_output_tokens=4)  # fmt: skip
            assert turn.usage is not None and turn.usage.input_tokens >= 2500
            job = client.responses.create(model="demo", input="Tell me a long story about bees.", background=True,
                                          temperature=0, max_output_tokens=120)  # fmt: skip
            seen = []
            for event in client.responses.retrieve(job.id, stream=True):
                seen.append(event.sequence_number)
                if len(seen) >= 6:
                    break
            # The conversation's full pages (written first: the writer keeps their order) are in.
            full_pages = turn.usage.input_tokens // 16
            deadline = time.monotonic() + 60
            while kv_pages(url, prefix) < full_pages and time.monotonic() < deadline:
                time.sleep(0.05)
            assert kv_pages(url, prefix) >= full_pages
            assert client.responses.retrieve(job.id).status == "in_progress"  # killed mid-generation
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
            second = start_server(
                demo_gguf, "--redis-url", url, *args, *keys_args(tmp_path), log=tmp_path / "b.log", prefix=prefix
            )
            client = openai.OpenAI(base_url=second.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)
            nxt = client.responses.create(model="demo", conversation=conv.id, input="How much did hive 3 give?",
                                          temperature=0, max_output_tokens=4)  # fmt: skip
            assert nxt.usage is not None
            assert nxt.usage.input_tokens_details.cached_tokens >= 0.8 * nxt.usage.input_tokens
            after = seen[-1]
            resumed = list(client.responses.retrieve(job.id, stream=True, starting_after=after))
            assert resumed and resumed[0].sequence_number == after + 1
            assert resumed[-1].type in ("response.completed", "response.incomplete")
            final = client.responses.retrieve(job.id)
            assert final.status in ("completed", "incomplete") and final.output_text
            assert f"taking over background response {job.id}" in (tmp_path / "b.log").read_text()
        finally:
            for server in (first, second):
                if server is not None and server.proc.poll() is None:
                    server.stop()
            delete_prefix(url, prefix)
