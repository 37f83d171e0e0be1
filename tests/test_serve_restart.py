"""SIGTERM with Responses in flight, then a second server on the same Redis (demo model, float32,
`--kv-redis-url` on the test Redis, `--api-keys-file`).

The first server is stopped while a foreground stream and a background job run: the stream ends
with `response.incomplete` (committed once: the conversation holds the turn once), the process
exits 0 within the grace, the background job is handed back to the queue rather than ended. The
second server finishes the job (its events go on after those the first one wrote) and continues
the conversation with cached tokens from the Redis KV tier, which `/metrics` counts."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import redis
from prometheus_client.parser import text_string_to_metric_families

from sessions.keys import Keys
from tests.cores import THREADS_ARG
from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.server import TEST_KEY, Server, keys_args, start_server

GRACE_S = 6  # foreground turns are stopped 3 s before its end
ARGS = (
    "--dtype", "float32", "--threads", THREADS_ARG, "--kv-cache-bytes", "256MiB", "--background-workers", "1",
    "--shutdown-grace-s", str(GRACE_S), "--served-model-name", "demo",
)  # fmt: skip
COUNT = "Count from 1 to 600, separated by commas."
# The background job: greedy, the demo model runs this to max_output_tokens (500), longer than
# the shutdown grace (COUNT alone ends after ~120 tokens, within the grace of a fast decode).
LONG = "Repeat the word 'hello' 600 times."
NOTES = " ".join(f"Note {i}: the hive number {i} gave {i % 7 + 3} kilos of honey." for i in range(30))


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)


def _events_stored(url: str, prefix: str, resp_id: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.xlen(Keys(prefix).events(resp_id)))
    finally:
        client.close()


def _redis_found(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "longctx:kv_redis_found_total":
                return float(s.value)
    return 0.0


def test_sigterm_hands_back_jobs_and_a_restart_continues(demo_gguf: Path, tmp_path: Path) -> None:
    prefix = unique_prefix()
    with shared_redis() as (url, _):
        args = ("--redis-url", url, "--kv-redis-url", url, *ARGS, *keys_args(tmp_path))
        first = start_server(demo_gguf, *args, log=tmp_path / "a.log", prefix=prefix)
        second = None
        try:
            client = _client(first)
            conv = client.conversations.create(items=[])
            turn = client.responses.create(
                model="demo", conversation=conv.id, input=NOTES, temperature=0, max_output_tokens=4
            )
            assert turn.usage is not None and turn.usage.input_tokens > 300
            job = client.responses.create(model="demo", input=LONG, background=True, temperature=0,
                                          max_output_tokens=500)  # fmt: skip
            deadline = time.monotonic() + 120
            while _events_stored(url, prefix, job.id) < 8:  # then the read below does not block
                assert time.monotonic() < deadline, first.log_tail()
                time.sleep(0.5)
            seen = []
            for event in client.responses.retrieve(job.id, stream=True):
                seen.append(event.sequence_number)
                if len(seen) >= 6:
                    break

            events: list[Any] = []
            streaming = threading.Event()

            def stream() -> None:
                try:
                    with client.responses.stream(model="demo", conversation=conv.id, input=COUNT, temperature=0,
                                                 max_output_tokens=300) as s:  # fmt: skip
                        for event in s:
                            events.append(event)
                            if event.type == "response.output_text.delta":
                                streaming.set()
                except Exception as e:  # shown by the assertion on the last event
                    events.append(e)
                finally:
                    streaming.set()

            reader = threading.Thread(target=stream, daemon=True)
            reader.start()
            assert streaming.wait(120) and events, first.log_tail()
            first.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            reader.join(GRACE_S + 30)
            assert first.proc.wait(timeout=GRACE_S + 60) == 0, first.log_tail()
            assert time.monotonic() - t0 < GRACE_S + 30  # the grace, plus stopping the engine on busy cores
            assert getattr(events[-1], "type", None) == "response.incomplete", (events[-3:], first.log_tail(30))
            stopped = events[-1].response
            assert stopped.incomplete_details is not None and stopped.incomplete_details.reason == "server_shutdown"
            assert "handed back to the queue" in first.log_tail(200)

            second = start_server(demo_gguf, *args, log=tmp_path / "b.log", prefix=prefix)
            client = _client(second)
            again = client.responses.retrieve(stopped.id)
            assert again.status == "incomplete" and again.output_text == stopped.output_text
            items = client.conversations.items.list(conv.id, order="asc").data
            assert len(items) == 4, [i.type for i in items]  # two turns, each once: user, assistant

            nxt = client.responses.create(
                model="demo", conversation=conv.id, input="Which hive gave the most?", temperature=0,
                max_output_tokens=4,
            )  # fmt: skip
            assert nxt.usage is not None and nxt.usage.input_tokens_details.cached_tokens > 0
            assert _redis_found(second) > 0

            deadline = time.monotonic() + 240
            final = client.responses.retrieve(job.id)
            while not final.status or final.status in ("queued", "in_progress"):
                assert time.monotonic() < deadline, second.log_tail()
                time.sleep(1)
                final = client.responses.retrieve(job.id)
            assert final.status in ("completed", "incomplete") and final.output_text
            resumed = list(client.responses.retrieve(job.id, stream=True, starting_after=seen[-1]))
            assert resumed[0].sequence_number == seen[-1] + 1
            assert resumed[-1].type in ("response.completed", "response.incomplete")
        finally:
            for server in (first, second):
                if server is not None and server.proc.poll() is None:
                    server.stop()
            delete_prefix(url, prefix)
