"""Chat Completions and Models over HTTP with the official `openai` client: `longctx serve` on the
demo model with the defaults users get (dtype auto, the compiled step with every bucket
self-checked, this CPU's kernels) and the shared test Redis. Text streamed and not, `parse` with a Pydantic
model, tools with streamed `delta.tool_calls` adding up, a tool round trip, logprobs, a seed, stop,
usage with cached tokens, the models list, and 4xx errors for what is not supported. The server
runs with `--api-keys-file` and two tenants: B never sees A's conversations, responses or cached
prompt pages; no key or a wrong one is 401."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from tests.cores import THREADS_ARG
from tests.demo_answers import IDS, QUESTIONS
from tests.redis_server import shared_redis
from tests.server import Server, running_server, wait_compiled

ARGS = (
    "--compile", "--threads", THREADS_ARG, "--kv-cache-bytes", "256MiB", "--background-workers", "0",
    "--max-num-seqs", "1", "--max-queued", "1", "--shutdown-grace-s", "5",
)  # fmt: skip
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False},
    },
}  # fmt: skip
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


KEYS = "# key tenant\nkey-a  tenant-a\nkey-b tenant-b  # the second tenant\n"


@pytest.fixture(scope="module")
def server(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("chat")
    (tmp / "keys").write_text(KEYS)
    args = (*ARGS, "--api-keys-file", str(tmp / "keys"))
    with shared_redis() as (url, _), running_server(demo_gguf, *args, log=tmp / "serve.log", redis_url=url) as s:
        wait_compiled(s)  # every test here runs on the compiled step, as a user's server soon does
        yield s


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return _client(server, "key-a")


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1 and client.models.retrieve(models[0].id).id == models[0].id
    return models[0].id


def test_text_streamed_and_not_with_usage_and_cache(client: openai.OpenAI, model: str) -> None:
    done = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    text = done.choices[0].message.content
    assert text and "Paris" in text and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage is not None and done.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=16, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    ))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.prompt_tokens_details is not None and (usage.prompt_tokens_details.cached_tokens or 0) > 0


@pytest.mark.parametrize(("question", "answer"), QUESTIONS, ids=IDS)
def test_the_defaults_answer_as_eager_float32(client: openai.OpenAI, model: str, question: str, answer: str) -> None:
    """The served defaults (dtype auto, every compiled bucket self-checked and switched in, this
    CPU's kernels) give eager float32's greedy answers."""
    messages: Any = [{"role": "user", "content": question}]
    done = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16)
    assert (done.choices[0].message.content or "").startswith(answer), done.choices[0].message.content


class Capital(BaseModel):
    country: str
    capital: str


def test_parse_with_pydantic(client: openai.OpenAI, model: str) -> None:
    done = client.chat.completions.parse(
        model=model,
        messages=QUESTION,
        response_format=Capital,
        temperature=0,
        max_tokens=60,  # type: ignore[arg-type]
    )
    parsed = done.choices[0].message.parsed
    assert parsed is not None and "Paris" in parsed.capital


def test_tools_streamed_and_round_trip(client: openai.OpenAI, model: str) -> None:
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: Any = {"model": model, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
                 "temperature": 0, "max_tokens": 40}  # fmt: skip
    done = client.chat.completions.create(messages=ask, **kw)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)  # type: ignore[union-attr]
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(messages=ask, stream=True, **kw):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments  # type: ignore[union-attr]
    back: Any = [
        *ask, msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(model=model, messages=back, tools=[WEATHER], temperature=0, max_tokens=30)
    assert answer.choices[0].message.content


def test_logprobs_seed_and_stop(client: openai.OpenAI, model: str) -> None:
    done = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=5,  # type: ignore[arg-type]
    )
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 5 and t.bytes is not None for t in content)
    seeded = [
        client.chat.completions.create(model=model, messages=QUESTION, temperature=1, seed=seed, max_tokens=12)  # type: ignore[arg-type]
        .choices[0].message.content
        for seed in (7, 7, 8, 9, 10)
    ]  # fmt: skip
    assert seeded[0] == seeded[1], "the same seed sampled another reply"
    assert set(seeded[2:]) - {seeded[0]}, f"other seeds all sampled seed 7's reply: {seeded}"
    full = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    text = full.choices[0].message.content or ""
    word = text.split()[1] if len(text.split()) > 1 else text[-2:]
    stopped = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=16,
        stop=[word],  # type: ignore[arg-type]
    )
    assert word not in (stopped.choices[0].message.content or "") and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"model": "gpt-4o"}, 404, "model"),
        ({"n": 2}, 400, "n"),
        ({"logit_bias": {"1": 5}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None),
        ({"messages": []}, 400, "messages"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, 400, "tool_choice"),
        ({"max_tokens": 10**9}, 400, "max_tokens"),
    ],
)
def test_bad_input(client: openai.OpenAI, model: str, extra: dict[str, Any], status: int, param: str | None) -> None:
    body: dict[str, Any] = {"model": model, "messages": QUESTION, "max_tokens": 2} | extra
    with pytest.raises(openai.APIStatusError) as e:
        client.post("/chat/completions", body=body, cast_to=object)
    assert e.value.status_code == status, e.value.body
    err = e.value.body
    assert isinstance(err, dict)
    if param is not None:
        assert str(err.get("param", "")).startswith(param), err
    assert client.models.list().data  # still serving


def test_tenants(server: Server, client: openai.OpenAI, model: str) -> None:
    other = _client(server, "key-b")
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
    resp = client.responses.create(model=model, input="Hello", max_output_tokens=2, temperature=0)
    for call in (
        lambda: other.conversations.retrieve(conv.id),
        lambda: other.conversations.items.list(conv.id),
        lambda: other.responses.retrieve(resp.id),
        lambda: other.responses.input_items.list(resp.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.conversations.retrieve(conv.id).id == conv.id
    ask: Any = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    for _ in range(2):
        a = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=2)
    b = other.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=2)
    assert a.usage is not None and a.usage.prompt_tokens_details is not None
    assert b.usage is not None and b.usage.prompt_tokens_details is not None
    assert (a.usage.prompt_tokens_details.cached_tokens or 0) > 0 and b.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    bare = httpx.get(server.url + "/v1/models", timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"


def test_body_limit_and_overload(server: Server, client: openai.OpenAI, model: str) -> None:
    """`--max-num-seqs 1 --max-queued 1` (so at most one waiting request per tenant too): of four
    concurrent streams at least one is refused with 429, Retry-After and `x-should-retry: true`;
    every other one completes."""
    big = httpx.post(
        server.url + "/v1/chat/completions", content=b"x" * (9 << 20),
        headers={"Authorization": "Bearer key-a", "Content-Type": "application/json"}, timeout=30,
    )  # fmt: skip
    assert big.status_code == 413

    def stream(_: int) -> str:
        try:
            chunks = client.chat.completions.create(
                model=model,
                messages=QUESTION,
                max_tokens=24,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
            )
            parts = [c for c in chunks if c.choices]
            assert parts[-1].choices[0].finish_reason in ("stop", "length")
            return "".join(c.choices[0].delta.content or "" for c in parts)
        except openai.RateLimitError as e:
            assert e.response.headers["retry-after"] and e.response.headers["x-should-retry"] == "true"
            return "429"

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(stream, range(4)))
    assert "429" in results and all(r for r in results), results
    assert any(r != "429" for r in results), results


def test_waiting_slot_released_when_the_client_leaves_early(server: Server, client: openai.OpenAI, model: str) -> None:
    """Streams closed by their client before the first token give back the tenant's waiting
    place and stop their engine request: the tenant is served again, nothing keeps running."""
    body = {"model": model, "messages": QUESTION, "max_tokens": 1000, "temperature": 0, "stream": True}
    headers = {"Authorization": "Bearer key-a"}

    def wait_idle() -> None:
        """Nothing waiting for tenant-a, nothing running or queued (a leaked place never clears)."""
        deadline = time.monotonic() + 60
        while True:
            m = _samples(httpx.get(server.url + "/metrics", timeout=10).text)
            busy = m.get('longctx:tenant_waiting_requests{tenant="tenant-a"}', 0) + m["longctx:num_requests_running"]
            if busy == 0 and m["longctx:num_requests_queued"] == 0:
                return
            assert time.monotonic() < deadline, m
            time.sleep(0.2)

    for _ in range(3):
        wait_idle()  # the previous stream's abort reaches the engine thread asynchronously
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200  # the headers only: the client leaves before any token
    wait_idle()
    done = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=2)  # type: ignore[arg-type]
    assert done.choices[0].message.content is not None


def _samples(text: str) -> dict[str, float]:
    """Every sample as `name{label="value",...}` -> value, read by prometheus_client's own parser
    (which raises on text that is not valid exposition format)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics(server: Server, client: openai.OpenAI, model: str) -> None:
    before = _samples(httpx.get(server.url + "/metrics", timeout=10).text)
    client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=3)  # type: ignore[arg-type]
    after = _samples(httpx.get(server.url + "/metrics", timeout=10).text)
    ttft = "longctx:time_to_first_token_seconds_count"
    assert after[ttft] == before.get(ttft, 0) + 1
    assert after['longctx:prompt_tokens_total{tenant="tenant-a"}'] > 0
    assert after["longctx:kv_pages_free"] > 0 and after["longctx:kv_prefix_queries_total"] > 0
    assert any(k.startswith("longctx:startup_phase_seconds{") for k in after)
    assert any('route="/chat/completions",status="200"' in k for k in after)
    queue = "longctx:engine_queue_time_seconds_count"
    assert after[queue] >= before.get(queue, 0) + 1
    assert after["longctx:model_load_bytes_per_second"] > 0 and after["longctx:process_resident_memory_bytes"] > 0
    for gauge in ("num_requests_loading", "kv_pages_used", "kv_host_bytes", "kv_prefetch_bytes"):
        assert f"longctx:{gauge}" in after
    for counter in ("stored", "hits", "evicted"):  # pages read ahead from the KV Redis, used, dropped
        assert f"longctx:kv_prefetch_{counter}_total" in after
    for reason in ("no_room", "unpinned", "pin_budget", "aborted"):  # restored pages left unused
        assert f'longctx:kv_restored_unused_pages_total{{reason="{reason}"}}' in after
    with client.responses.stream(model=model, input="Hi", max_output_tokens=3, temperature=0) as events:
        for _ in events:
            pass
    last = _samples(httpx.get(server.url + "/metrics", timeout=10).text)
    assert last[ttft] == after[ttft] + 1  # a streamed response counts as well


def test_compiled_buckets_self_checked_on_ready_and_metrics(server: Server) -> None:
    """The background compile self-checked every bucket against the eager modules: all passed
    here (the fixture waited for it), and `/ready` and `/metrics` say which buckets are compiled."""
    ready = httpx.get(server.url + "/ready", timeout=10).json()
    assert ready["compiled_buckets"] == [1, 2, 4, 8, 16, 32, 64] and ready["eager_buckets"] == {}, ready
    assert ready["compiling_buckets"] == [], ready
    assert "compile" in ready["phase_seconds"]
    samples = _samples(httpx.get(server.url + "/metrics", timeout=10).text)
    assert samples["longctx:compiled_bucket_mismatch_total"] == 0
    assert all(samples[f'longctx:compiled_bucket{{bucket="{b}"}}'] == 1 for b in (1, 2, 4, 8, 16, 32, 64))
    assert 0 < samples['longctx:compiled_bucket_logits_error{bucket="1"}'] < 5e-2
    assert samples["longctx:compiled_buckets_compiling"] == 0
    assert "self-checked 7 compiled buckets" in server.log.read_text(errors="replace")


def test_longctx_chat_piped(server: Server) -> None:
    base = ["-m", "api.cli", "chat", "--base-url", server.url + "/v1", "--api-key", "key-a", "--max-output-tokens", "8"]
    cmd = [sys.executable, *base]
    first = subprocess.run(cmd, input="What is the capital of France?\n", capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    conv = re.search(r"conversation: (conv_\S+)", first.stdout)
    assert conv is not None and len(first.stdout.strip().splitlines()) >= 2, first.stdout
    again = subprocess.run(
        [*cmd, "--conversation", conv.group(1)], input="And of Germany?\n", capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and conv.group(1) in again.stdout, again.stderr
    other = _client(server, "key-a").conversations.items.list(conv.group(1))
    assert len(other.data) == 4


def test_sigterm_with_a_stream_in_flight(server: Server, client: openai.OpenAI, model: str) -> None:
    """Last in the module: it stops the server. The stream ends whole (its last chunk has a finish
    reason: stopped within the grace if need be), the process exits 0."""
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=400,
        temperature=1,
        seed=1,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = iter(stream)
    next(chunks)
    server.proc.send_signal(signal.SIGTERM)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]  # no error: the stream ends whole
    assert finish and finish[-1] in ("stop", "length"), finish[-3:]
    assert server.proc.wait(timeout=60) == 0, server.log_tail()
