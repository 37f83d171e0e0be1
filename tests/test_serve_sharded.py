"""`longctx serve --tensor-parallel-size 2` and `--pipeline-parallel-size 2` (compiled, with the Redis
KV tier) and both at once with int8 weights, on the tiny Llama (demo tokenizer), through the
`openai` client. The engine process is rank 0 and spawns the others. Each layout lives a
server's whole life in one test: its conversation answers what a single eager process answers
(greedy, float32), each rank writes its slices of the pages to Redis, SIGKILL of rank 1 turns
`/ready` 503 with an error naming it and the server exits 1, and a new server on the same Redis
finds the conversation's next turn cached."""

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

from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.server import TEST_KEY, Server, http_get, keys_args, running_server, start_server

pytestmark = pytest.mark.slow
ARGS = ("--dtype", "float32", "--kv-cache-bytes", "16MiB", "--served-model-name", "tiny", "--background-workers", "0")
TP2 = ("--tensor-parallel-size", "2", "--threads", "1")
PP2 = ("--pipeline-parallel-size", "2", "--pipeline-layer-split", "1,1", "--threads", "1")
INT8 = ("--quantization", "int8")
# The buckets the conversations run in (decoding; prompts and their cached-prefix chunks of <= 64
# tokens, padded): each rank compiles these before the server is ready.
COMPILED = ("--compile", "--compile-buckets", "1,64")
QUESTIONS = ("Name three colours.", "And three animals?")
NOTES = " ".join(f"Note {i}: the hive number {i} gave {i % 7 + 3} kilos of honey." for i in range(12))
Turns = list[tuple[list[str], list[float], int]]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)


def _conversation(server: Server, questions: tuple[str, ...] = QUESTIONS) -> Turns:
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


def _same_conversation(got: Turns, expected: Turns) -> None:
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(got, expected, strict=True):
        assert tokens == ref_tokens and len(tokens) == 12
        assert logprobs == pytest.approx(ref_logprobs, rel=1e-4, abs=1e-4)
    assert got[1][2] > 0  # the second turn's prompt came from the cache


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with shared_redis() as (url, _):
        yield url


@pytest.fixture(scope="module")
def one_process(tiny_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Turns]:
    """The conversation on a single eager process, float32 and int8: what every layout must answer."""
    tmp = tmp_path_factory.mktemp("one")
    keys = keys_args(tmp)
    turns = {}
    for name, extra in (("float32", ()), ("int8", INT8)):
        with running_server(tiny_model, *ARGS, *extra, *keys, log=tmp / f"{name}.log", redis_url=redis_url) as one:
            turns[name] = _conversation(one)
    return turns


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
def test_sharded_server_answers_dies_naming_the_rank_and_restarts_from_its_slices(
    tiny_model: Path, redis_url: str, one_process: dict[str, Turns], tmp_path: Path, layout: tuple[str, ...]
) -> None:
    """TP=2 (or PP=2, one layer per stage), compiled, with the Redis KV tier:
    - every rank compiled and self-checked the chosen buckets before the server was ready
      (`/ready` lists them compiled);
    - the conversation's tokens and logprobs equal one eager process's;
    - a long turn: each rank wrote its slices of the pages (its heads, or its stage's layers)
      under its own namespace, every page in both;
    - SIGKILL of rank 1: `/ready` 503 `engine_stopped` naming it, then the server exits 1;
    - a new (eager) server on the same Redis: the conversation's next turn finds >= 80% of its
      prompt cached (every rank restored its slices)."""
    prefix = unique_prefix()
    args = ("--redis-url", redis_url, "--kv-redis-url", redis_url, *ARGS, *layout, *keys_args(tmp_path))
    log = tmp_path / "a.log"
    first = start_server(tiny_model, *args, *COMPILED, log=log, prefix=prefix)
    try:
        status, ready = http_get(first.url + "/ready")
        assert status == 200 and ready["compiled_buckets"] == [1, 64] and not ready["eager_buckets"], ready
        assert not ready.get("compiling_buckets"), ready  # checked before it was ready
        got = _conversation(first)
        client = _client(first)
        conv = client.conversations.create(items=[])
        turn = client.responses.create(model="tiny", conversation=conv.id, input=NOTES, temperature=0,
                                       max_output_tokens=4)  # fmt: skip
        assert turn.usage is not None and turn.usage.input_tokens > 200
        # Each rank's writer stores its slices within about a second; a turn's commit waits only
        # `--kv-commit-wait-ms` (50) for them and marks the rest pending. Killing rank 1 before its
        # writer is done would lose its queued slices: the kill waits for both to land.
        deadline, before = time.monotonic() + 30, dict[str, int]()
        while time.monotonic() < deadline:
            landed = _pages_by_namespace(redis_url, f"{prefix}:kv:")
            if len(landed) == 2 and len(set(landed.values())) == 1 and landed == before:
                break  # the same count in both, and no longer growing
            before = landed
            time.sleep(0.3)
        text = log.read_text()
        spawned = re.search(r"spawned rank 1 \(pid (\d+)\)", text)
        assert spawned is not None, first.log_tail()
        os.kill(int(spawned.group(1)), signal.SIGKILL)
        stopped = _stopped_bodies(first)
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    try:
        _same_conversation(got, one_process["float32"])
        if layout == TP2:
            assert "rank 1 of 2 ready" in text, text[-3000:]
            assert text.count("self-checked 2 compiled buckets") == 2, text[-3000:]  # each rank
        else:
            assert re.search(r"rank 1 \(stage 1 of 2\): .* loaded", text), text[-3000:]
        assert first.proc.returncode == 1, first.log_tail()
        assert stopped, first.log_tail()
        message = str(stopped[-1]["error"])  # the first may come before the reason is in
        assert "rank 1 failed" in message and "SIGKILL" in message, stopped
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
    finally:
        delete_prefix(redis_url, prefix)


def test_pipeline_by_tensor_parallel_int8_conversation_equals_one_process(
    tiny_model: Path, redis_url: str, one_process: dict[str, Turns], tmp_path: Path
) -> None:
    """PP=2 x TP=2 (four ranks: rank 0 spawns three) with int8 weights, compiled: the
    conversation's tokens and logprobs equal one eager int8 process's, and the second turn's
    prompt comes from the cache."""
    log = tmp_path / "pp2tp2.log"
    four = ("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", "--threads", "1")
    keys = keys_args(tmp_path)
    with running_server(tiny_model, *ARGS, *four, *INT8, *COMPILED, *keys, log=log, redis_url=redis_url) as sharded:
        status, ready = http_get(sharded.url + "/ready")
        assert status == 200 and ready["compiled_buckets"] == [1, 64], ready
        got = _conversation(sharded)
        text = log.read_text()
    assert all(f"spawned rank {r}" in text for r in (1, 2, 3)), text[-3000:]
    _same_conversation(got, one_process["int8"])
