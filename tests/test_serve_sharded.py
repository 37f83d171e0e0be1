"""`longctx serve --tensor-parallel-size 2` (compiled), `--pipeline-parallel-size 2` and both with
int8 weights on the tiny Llama (demo tokenizer), through the `openai` client: the engine process
is rank 0 and spawns the others; a conversation answers what a single-process server answers
(greedy, float32); SIGKILL of rank 1 turns `/ready` 503 with an error naming it, then the
server exits 1."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from engine.model.compiled import BUCKETS
from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.server import TEST_KEY, Server, http_get, keys_args, running_server, start_server

pytestmark = pytest.mark.slow
ARGS = ("--dtype", "float32", "--kv-cache-bytes", "16MiB", "--served-model-name", "tiny", "--background-workers", "0")
TP2 = ("--tensor-parallel-size", "2", "--threads", "1")
PP2 = ("--pipeline-parallel-size", "2", "--pipeline-layer-split", "1,1", "--threads", "1")
QUESTIONS = ("Name three colours.", "And three animals?")


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)


def _conversation(server: Server, questions: tuple[str, ...] = QUESTIONS) -> list[tuple[list[str], list[float], int]]:
    """Greedy turns of one conversation (Chat Completions, the history sent back each turn): per
    turn, its tokens, their logprobs and the prompt tokens the server found cached."""
    client = _client(server)
    messages: list[Any] = []
    turns = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=0,
            max_tokens=12,
            logprobs=True,  # type: ignore[arg-type]
        )
        choice = r.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content and r.usage is not None
        details = r.usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None and details.cached_tokens else 0
        turns.append(([t.token for t in choice.logprobs.content], [t.logprob for t in choice.logprobs.content], cached))
        messages.append({"role": "assistant", "content": choice.message.content or ""})
    return turns


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with shared_redis() as (url, _):
        yield url


def test_tensor_parallel_conversation_equals_one_process(tiny_model: Path, redis_url: str, tmp_path: Path) -> None:
    """TP=2 with the compiled step (the default on CPU): both ranks compile and self-check every
    bucket before the server is ready, `/ready` lists them all compiled, and the conversation
    equals an eager single process's."""
    keys = keys_args(tmp_path)
    with running_server(tiny_model, *ARGS, *keys, log=tmp_path / "one.log", redis_url=redis_url) as one:
        expected = _conversation(one)
    log = tmp_path / "tp2.log"
    with running_server(tiny_model, *ARGS, *TP2, "--compile", *keys, log=log, redis_url=redis_url) as tp:
        status, ready = http_get(tp.url + "/ready")
        assert status == 200, ready
        assert ready["compiled_buckets"] == list(BUCKETS) and not ready["eager_buckets"], ready
        assert not ready.get("compiling_buckets"), ready  # checked before it was ready
        got = _conversation(tp)
        text = log.read_text()
        assert "spawned rank 1" in text and "rank 1 of 2 ready" in text, text[-3000:]
        assert text.count(f"self-checked {len(BUCKETS)} compiled buckets") == 2, text[-3000:]  # each rank
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(got, expected, strict=True):
        assert tokens == ref_tokens and len(tokens) == 12
        assert logprobs == pytest.approx(ref_logprobs, rel=1e-4, abs=1e-4)


def test_rank_death_stops_the_server_naming_it(tiny_model: Path, redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "tp2.log"
    server = start_server(tiny_model, "--redis-url", redis_url, *ARGS, *TP2, *keys_args(tmp_path), log=log)
    try:
        spawned = re.search(r"spawned rank 1 \(pid (\d+)\)", log.read_text())
        assert spawned is not None, server.log_tail()
        os.kill(int(spawned.group(1)), signal.SIGKILL)
        bodies = []
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            status, body = http_get(server.url + "/ready", timeout_s=2.0)
            if status == 503:
                bodies.append(body)
            time.sleep(0.05)
        code = server.proc.wait(timeout=30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert code == 1, server.log_tail()
    stopped = [b for b in bodies if b.get("phase") == "engine_stopped"]
    assert stopped, bodies
    error = stopped[-1]["error"]  # the first may come before the reason is in
    assert isinstance(error, dict) and "rank 1 failed" in str(error["message"]), stopped
    assert "SIGKILL" in str(error["message"])


def test_pipeline_conversation_equals_one_process_then_a_dead_stage_stops_it(
    tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    """PP=2 (one layer per stage, compiled): the conversation's tokens and logprobs equal one
    eager process's; then SIGKILL of stage 1 makes `/ready` 503 naming it, and the server exits 1."""
    keys = keys_args(tmp_path)
    with running_server(tiny_model, *ARGS, *keys, log=tmp_path / "one.log", redis_url=redis_url) as one:
        expected = _conversation(one)
    log = tmp_path / "pp2.log"
    server = start_server(tiny_model, "--redis-url", redis_url, *ARGS, *PP2, "--compile", *keys, log=log)
    try:
        status, ready = http_get(server.url + "/ready")
        assert status == 200 and ready["compiled_buckets"] == list(BUCKETS), ready  # each stage compiled its layers
        got = _conversation(server)
        text = log.read_text()
        assert re.search(r"rank 1 \(stage 1 of 2\): .* loaded", text), text[-3000:]
        spawned = re.search(r"spawned rank 1 \(pid (\d+)\)", text)
        assert spawned is not None, server.log_tail()
        os.kill(int(spawned.group(1)), signal.SIGKILL)
        stopped = _stopped_bodies(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(got, expected, strict=True):
        assert tokens == ref_tokens and len(tokens) == 12
        assert logprobs == pytest.approx(ref_logprobs, rel=1e-4, abs=1e-4)
    assert got[1][2] > 0  # the second turn's prompt came from the prefix cache
    assert server.proc.returncode == 1, server.log_tail()
    assert stopped, server.log_tail()
    message = str(stopped[-1]["error"])
    assert "rank 1 failed" in message and "SIGKILL" in message, stopped


def test_pipeline_by_tensor_parallel_int8_conversation_equals_one_process(
    tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    """PP=2 x TP=2 (four ranks: rank 0 spawns three) with int8 weights, compiled: the
    conversation's tokens and logprobs equal one eager int8 process's, and the second turn's
    prompt comes from the cache."""
    keys = keys_args(tmp_path)
    int8 = ("--quantization", "int8")
    with running_server(tiny_model, *ARGS, *int8, *keys, log=tmp_path / "one.log", redis_url=redis_url) as one:
        expected = _conversation(one)
    log = tmp_path / "pp2tp2.log"
    four = ("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", "--threads", "1")
    with running_server(tiny_model, *ARGS, *four, *int8, "--compile", *keys, log=log, redis_url=redis_url) as sharded:
        status, ready = http_get(sharded.url + "/ready")
        assert status == 200 and ready["compiled_buckets"] == list(BUCKETS), ready
        got = _conversation(sharded)
        text = log.read_text()
    assert all(f"spawned rank {r}" in text for r in (1, 2, 3)), text[-3000:]
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(got, expected, strict=True):
        assert tokens == ref_tokens and len(tokens) == 12
        assert logprobs == pytest.approx(ref_logprobs, rel=1e-4, abs=1e-4)
    assert got[1][2] > 0


def _stopped_bodies(server: Server) -> list[dict[str, Any]]:
    """`/ready`'s 503 `engine_stopped` bodies until the server exits (at most 60 s, then 30)."""
    bodies = []
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        status, body = http_get(server.url + "/ready", timeout_s=2.0)
        if status == 503 and body.get("phase") == "engine_stopped":
            bodies.append(body)
        time.sleep(0.05)
    server.proc.wait(timeout=30)
    return bodies


NOTES = " ".join(f"Note {i}: the hive number {i} gave {i % 7 + 3} kilos of honey." for i in range(12))


def _pages_by_namespace(url: str, prefix: str) -> dict[str, int]:
    client = redis.Redis.from_url(url)
    try:
        counts: dict[str, int] = {}
        for key in client.scan_iter(match=prefix + "*", count=1000):
            parts = key.decode().removeprefix(prefix).split(":")
            if len(parts) == 2:  # namespace:hash (not a `:pending` mark)
                counts[parts[0]] = counts.get(parts[0], 0) + 1
        return counts
    finally:
        client.close()


@pytest.mark.parametrize("layout", [TP2, PP2], ids=["tp2", "pp2"])
def test_restart_restores_each_ranks_kv_slices_from_redis(
    tiny_model: Path, redis_url: str, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    """TP=2 (or PP=2) with the Redis KV tier: a turn, SIGKILL of the server, a second server on
    the same Redis: the next turn of the conversation finds >= 80% of its prompt cached (every
    rank's slices of those pages, its heads or its stage's layers, were there)."""
    prefix = unique_prefix()
    args = ("--redis-url", redis_url, "--kv-redis-url", redis_url, *ARGS, *layout, *keys_args(tmp_path))
    first = start_server(tiny_model, *args, log=tmp_path / "a.log", prefix=prefix)
    try:
        client = _client(first)
        conv = client.conversations.create(items=[])
        turn = client.responses.create(model="tiny", conversation=conv.id, input=NOTES, temperature=0,
                                       max_output_tokens=4)  # fmt: skip
        assert turn.usage is not None and turn.usage.input_tokens > 200
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    slices = _pages_by_namespace(redis_url, f"{prefix}:kv:")
    assert len(slices) == 2 and len(set(slices.values())) == 1, slices  # one namespace per rank, every page in both
    second = start_server(tiny_model, *args, log=tmp_path / "b.log", prefix=prefix)
    try:
        nxt = _client(second).responses.create(model="tiny", conversation=conv.id, input="Which hive gave most?",
                                               temperature=0, max_output_tokens=4)  # fmt: skip
        assert nxt.usage is not None
        cached = nxt.usage.input_tokens_details.cached_tokens
        assert cached >= 0.8 * nxt.usage.input_tokens, (cached, nxt.usage.input_tokens, second.log_tail())
    finally:
        assert second.stop() == 0, second.log_tail()
        delete_prefix(redis_url, prefix)
