"""Chat Completions and Models over HTTP with the official `openai` client: `longctx serve` on the
demo model (float32) and the shared test Redis. Text streamed and not, `parse` with a Pydantic
model, tools with streamed `delta.tool_calls` adding up, a tool round trip, logprobs, a seed, stop,
usage with cached tokens, the models list, and 4xx errors for what is not supported. The server
runs with `--api-keys-file` and two tenants: B never sees A's conversations, responses or cached
prompt pages; no key or a wrong one is 401."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.redis_server import shared_redis
from tests.server import Server, running_server

ARGS = ("--dtype", "float32", "--threads", "2", "--kv-cache-bytes", "256MiB", "--background-workers", "0")
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False},
    },
}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


KEYS = "# key tenant\nkey-a  tenant-a\nkey-b tenant-b  # the second tenant\n"


@pytest.fixture(scope="module")
def server(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("chat")
    (tmp / "keys").write_text(KEYS)
    args = (*ARGS, "--api-keys-file", str(tmp / "keys"))
    with shared_redis() as (url, _), running_server(demo_gguf, *args, log=tmp / "serve.log", redis_url=url) as s:
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
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens > 0


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
        client.chat.completions.create(model=model, messages=QUESTION, temperature=1, seed=7, max_tokens=12)  # type: ignore[arg-type]
        .choices[0].message.content
        for _ in range(2)
    ]  # fmt: skip
    assert seeded[0] == seeded[1]
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
    assert a.usage.prompt_tokens_details.cached_tokens > 0 and b.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    bare = httpx.get(server.url + "/v1/models", timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
