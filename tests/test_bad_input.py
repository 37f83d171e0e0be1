"""Bad input over every route: a 4xx with OpenAI's error object naming the field, Redis unchanged,
the server still serving; unknown fields ignored; the served OpenAPI schema typed for every
route, and a bounded schemathesis run against it (`tests/openapi_checks.py`). One server for the
module: demo model, two tenants, a small body limit, context and output cap.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import msgspec
import openai
import pytest
import redis

from tests.cores import THREADS_ARG
from tests.openapi_checks import check_schemas_typed, run_schemathesis
from tests.redis_server import shared_redis
from tests.server import Server, running_server

pytestmark = pytest.mark.slow

KEYS = "key-a tenant-a\nkey-b tenant-b\n"
ARGS = (
    "--threads", THREADS_ARG, "--kv-cache-bytes", "64MiB", "--background-workers", "0", "--served-model-name", "demo",
    "--max-model-len", "1024", "--max-body-bytes", "16KiB", "--max-output-tokens", "4", "--kv-redis-url", "none",
    "--hosted-tools", "reject",
)  # fmt: skip
COUNTERS = (":fence", ":layout")  # keys that change legitimately on a refused request (the fence, the layout mark)
LONG = "word " * 1500  # about 1500 tokens: more than --max-model-len, less than the body limit
HUGE = "x" * 20_000  # over --max-body-bytes
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
OUT = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
CHAT_FN = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Hi"}]


@dataclass
class Served:
    server: Server
    redis_url: str
    conv: str  # tenant A's conversation
    item: str  # an item of it
    resp: str  # tenant A's foreground response


@pytest.fixture(scope="module")
def served(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "keys").write_text(KEYS)
    args = (*ARGS, "--api-keys-file", str(tmp / "keys"))
    with shared_redis() as (url, _), running_server(demo_gguf, *args, log=tmp / "serve.log", redis_url=url) as s:
        a = openai.OpenAI(base_url=s.url + "/v1", api_key="key-a", max_retries=0, timeout=60)
        conv = a.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
        item = a.conversations.items.list(conv.id).data[0].id
        resp = a.responses.create(model="demo", input="Hello", max_output_tokens=2, temperature=0)
        assert item is not None
        yield Served(s, url, conv.id, item, resp.id)


# (name, method, path, body: dict | bytes | None, key, status, param: the error's param or None, words in the message)
CASES: list[tuple[str, str, str, Any, str | None, int, str | None, tuple[str, ...]]] = [
    # ---- responses ----
    ("malformed json", "POST", "/v1/responses", b'{"model": "demo",', "key-a", 400, None, ("JSON",)),
    ("not an object", "POST", "/v1/responses", b"[1]", "key-a", 400, None, ("body", "object")),
    ("empty body", "POST", "/v1/responses", b"", "key-a", 400, None, ("body",)),
    ("lone surrogate", "POST", "/v1/responses", b'{"model": "demo", "input": "\\ud800"}', "key-a", 400, None,
     ("JSON",)),
    ("reasoning only", "POST", "/v1/responses", {"model": "demo", "input": [{"type": "reasoning", "summary": []}]},
     "key-a", 400, "input", ("no message",)),
    ("wrong type", "POST", "/v1/responses", {"model": "demo", "input": "x", "temperature": "hot"}, "key-a", 400,
     "temperature", ()),
    ("wrong nested type", "POST", "/v1/responses", {"model": "demo", "input": "x", "reasoning": {"effort": 3}},
     "key-a", 400, "reasoning.effort", ()),
    ("missing input", "POST", "/v1/responses", {"model": "demo"}, "key-a", 400, "input", ()),
    ("out of range", "POST", "/v1/responses", {"model": "demo", "input": "x", "top_p": 7}, "key-a", 400, "top_p", ()),
    ("conversation and previous", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "conversation": "{conv}", "previous_response_id": "{resp}"}, "key-a", 400,
     "conversation", ("previous_response_id",)),
    ("unknown conversation", "POST", "/v1/responses", {"model": "demo", "input": "x", "conversation": "conv_nope"},
     "key-a", 404, "conversation", ("conv_nope",)),
    ("unknown previous", "POST", "/v1/responses", {"model": "demo", "input": "x", "previous_response_id": "resp_no"},
     "key-a", 404, "previous_response_id", ("resp_no",)),
    ("unknown call_id", "POST", "/v1/responses", {"model": "demo", "input": [OUT | {"call_id": "c9"}]}, "key-a", 400,
     "input[0].call_id", ("c9",)),
    ("answered call_id", "POST", "/v1/responses", {"model": "demo", "input": [CALL, OUT, OUT]}, "key-a", 400,
     "input[2].call_id", ("answered",)),
    ("output for conversation", "POST", "/v1/responses",
     {"model": "demo", "conversation": "{conv}", "input": [OUT]}, "key-a", 400, "input[0].call_id", ()),
    ("invalid tool schema", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "tools": [FN | {"parameters": {"type": "objekt"}}]}, "key-a", 400,
     "tools[0].parameters", ()),
    ("undeclared tool_choice", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "tools": [FN], "tool_choice": {"type": "function", "name": "other"}}, "key-a",
     400, "tool_choice", ("other",)),
    ("required without tools", "POST", "/v1/responses", {"model": "demo", "input": "x", "tool_choice": "required"},
     "key-a", 400, "tool_choice", ("tools",)),
    ("json_schema without schema", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "key-a", 400,
     "text.format", ("schema",)),
    ("foreign compaction", "POST", "/v1/responses",
     {"model": "demo", "input": [{"type": "compaction", "encrypted_content": "forged"}]}, "key-a", 400,
     "input[0].encrypted_content", ()),
    ("context too long", "POST", "/v1/responses", {"model": "demo", "input": LONG}, "key-a", 400, "input",
     ("1024", "tokens")),
    ("too many output tokens", "POST", "/v1/responses", {"model": "demo", "input": "x", "max_output_tokens": 99},
     "key-a", 400, "max_output_tokens", ("4",)),
    ("web_search", "POST", "/v1/responses", {"model": "demo", "input": "x", "tools": [{"type": "web_search"}]},
     "key-a", 400, "tools[0].type", ("web_search", "cannot run")),
    ("file_search", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "key-a", 400,
     "tools[0].type", ("file_search", "cannot run")),
    ("mcp", "POST", "/v1/responses", {"model": "demo", "input": "x", "tools": [{"type": "mcp", "server_label": "s"}]},
     "key-a", 400, "tools[0].type", ("mcp", "cannot run")),
    ("unknown tool type", "POST", "/v1/responses", {"model": "demo", "input": "x", "tools": [{"type": "oracle"}]},
     "key-a", 400, "tools[0].type", ("oracle", "unknown tool type")),
    ("namespace without tools", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": []}]}, "key-a", 400,
     "tools[0].tools", ()),
    ("hosted tool in a namespace", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
     "key-a", 400, "tools[0].tools[0].type", ()),
    ("custom tool bad lark", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "tools": [{"type": "custom", "name": "c", "format": {
         "type": "grammar", "syntax": "lark", "definition": "start: ("}}]}, "key-a", 400,
     "tools[0].format.definition", ("lark",)),
    ("custom tool bad syntax", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "tools": [{"type": "custom", "name": "c", "format": {
         "type": "grammar", "syntax": "peg", "definition": "x"}}]}, "key-a", 400, "tools[0].format.syntax", ()),
    ("unknown item type", "POST", "/v1/responses", {"model": "demo", "input": [{"type": "hologram"}]}, "key-a", 400,
     "input[0].type", ("hologram",)),
    ("custom output for a function call", "POST", "/v1/responses",
     {"model": "demo", "input": [CALL, {"type": "custom_tool_call_output", "call_id": "c1", "output": "x"}]},
     "key-a", 400, "input[1].call_id", ("custom_tool_call",)),
    ("bad prompt_cache_retention", "POST", "/v1/responses",
     {"model": "demo", "input": "x", "prompt_cache_retention": "forever"}, "key-a", 400, "prompt_cache_retention", ()),
    ("image part", "POST", "/v1/responses",
     {"model": "demo", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "key-a", 400, "input[0].content[0].type", ("input_image", "not supported", "the model demo")),
    ("unknown model", "POST", "/v1/responses", {"model": "gpt-4o", "input": "x"}, "key-a", 404, "model", ("gpt-4o",)),
    ("compact: no model", "POST", "/v1/responses/compact", {"input": "x"}, "key-a", 400, "model", ()),
    ("compact: unknown model", "POST", "/v1/responses/compact", {"model": "m", "input": "x"}, "key-a", 404, "model",
     ()),
    ("compact: foreign item", "POST", "/v1/responses/compact",
     {"model": "demo", "input": [{"type": "compaction", "encrypted_content": "forged"}]}, "key-a", 400,
     "input[0].encrypted_content", ()),
    ("compact: malformed", "POST", "/v1/responses/compact", b"{", "key-a", 400, None, ("JSON",)),
    ("cancel foreground", "POST", "/v1/responses/{resp}/cancel", None, "key-a", 400, "response_id", ("background",)),
    ("cancel unknown", "POST", "/v1/responses/resp_nope/cancel", None, "key-a", 404, None, ("resp_nope",)),
    ("retrieve unknown", "GET", "/v1/responses/resp_nope", None, "key-a", 404, None, ("resp_nope",)),
    ("stream unknown", "GET", "/v1/responses/resp_nope?stream=true", None, "key-a", 404, None, ("resp_nope",)),
    ("stream foreground", "GET", "/v1/responses/{resp}?stream=true", None, "key-a", 400, "stream", ("background",)),
    ("bad starting_after", "GET", "/v1/responses/{resp}?stream=true&starting_after=x", None, "key-a", 400,
     "starting_after", ()),
    ("delete unknown", "DELETE", "/v1/responses/resp_nope", None, "key-a", 404, None, ("resp_nope",)),
    ("input_items unknown", "GET", "/v1/responses/resp_nope/input_items", None, "key-a", 404, None, ("resp_nope",)),
    ("input_items limit", "GET", "/v1/responses/{resp}/input_items?limit=0", None, "key-a", 400, "limit", ()),
    ("input_items limit type", "GET", "/v1/responses/{resp}/input_items?limit=x", None, "key-a", 400, "limit", ()),
    ("input_items order", "GET", "/v1/responses/{resp}/input_items?order=up", None, "key-a", 400, "order", ()),
    # ---- conversations ----
    ("conv: malformed", "POST", "/v1/conversations", b"{", "key-a", 400, None, ("JSON",)),
    ("conv: items type", "POST", "/v1/conversations", {"items": 5}, "key-a", 400, "items", ()),
    ("conv: bad item", "POST", "/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}, "key-a", 400,
     "items[0]", ()),
    ("conv: metadata", "POST", "/v1/conversations", {"metadata": {"a": 1}}, "key-a", 400, "metadata", ()),
    ("conv: unknown", "GET", "/v1/conversations/conv_nope", None, "key-a", 404, None, ("conv_nope",)),
    ("conv: update unknown", "POST", "/v1/conversations/conv_nope", {"metadata": {}}, "key-a", 404, None, ()),
    ("conv: update metadata", "POST", "/v1/conversations/{conv}", {"metadata": "x"}, "key-a", 400, "metadata", ()),
    ("conv: delete unknown", "DELETE", "/v1/conversations/conv_nope", None, "key-a", 404, None, ()),
    ("conv: items unknown", "GET", "/v1/conversations/conv_nope/items", None, "key-a", 404, None, ()),
    ("conv: items order", "GET", "/v1/conversations/{conv}/items?order=up", None, "key-a", 400, "order", ()),
    ("conv: add none", "POST", "/v1/conversations/{conv}/items", {}, "key-a", 400, "items", ()),
    ("conv: add image", "POST", "/v1/conversations/{conv}/items",
     {"items": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "key-a", 400,
     "items[0].content[0].type", ("not supported", "the model demo")),
    ("conv: add unknown", "POST", "/v1/conversations/conv_nope/items", {"items": USER}, "key-a", 404, None, ()),
    ("conv: item unknown", "GET", "/v1/conversations/{conv}/items/msg_nope", None, "key-a", 404, None, ()),
    ("conv: delete item unknown", "DELETE", "/v1/conversations/{conv}/items/msg_nope", None, "key-a", 404, None, ()),
    # ---- another tenant's ids ----
    ("tenant: conversation", "GET", "/v1/conversations/{conv}", None, "key-b", 404, None, ()),
    ("tenant: update", "POST", "/v1/conversations/{conv}", {"metadata": {"a": "b"}}, "key-b", 404, None, ()),
    ("tenant: delete conversation", "DELETE", "/v1/conversations/{conv}", None, "key-b", 404, None, ()),
    ("tenant: items", "GET", "/v1/conversations/{conv}/items", None, "key-b", 404, None, ()),
    ("tenant: add items", "POST", "/v1/conversations/{conv}/items", {"items": USER}, "key-b", 404, None, ()),
    ("tenant: item", "GET", "/v1/conversations/{conv}/items/{item}", None, "key-b", 404, None, ()),
    ("tenant: delete item", "DELETE", "/v1/conversations/{conv}/items/{item}", None, "key-b", 404, None, ()),
    ("tenant: response", "GET", "/v1/responses/{resp}", None, "key-b", 404, None, ()),
    ("tenant: delete response", "DELETE", "/v1/responses/{resp}", None, "key-b", 404, None, ()),
    ("tenant: input_items", "GET", "/v1/responses/{resp}/input_items", None, "key-b", 404, None, ()),
    ("tenant: cancel", "POST", "/v1/responses/{resp}/cancel", None, "key-b", 404, None, ()),
    ("tenant: turn", "POST", "/v1/responses", {"model": "demo", "input": "x", "conversation": "{conv}"}, "key-b",
     404, "conversation", ()),
    ("tenant: chain", "POST", "/v1/responses", {"model": "demo", "input": "x", "previous_response_id": "{resp}"},
     "key-b", 404, "previous_response_id", ()),
    # ---- chat completions and models ----
    ("chat: malformed", "POST", "/v1/chat/completions", b'{"model"', "key-a", 400, None, ("JSON",)),
    ("chat: wrong type", "POST", "/v1/chat/completions", {"model": "demo", "messages": USER, "max_tokens": "x"},
     "key-a", 400, "max_tokens", ()),
    ("chat: no messages", "POST", "/v1/chat/completions", {"model": "demo"}, "key-a", 400, "messages", ()),
    ("chat: no model", "POST", "/v1/chat/completions", {"messages": USER}, "key-a", 400, "model", ()),
    ("chat: bad role", "POST", "/v1/chat/completions", {"model": "demo", "messages": [{"role": "x"}]}, "key-a", 400,
     "messages[0].role", ()),
    ("chat: empty stop", "POST", "/v1/chat/completions", {"model": "demo", "messages": USER, "stop": [""]}, "key-a",
     400, "stop", ("non-empty",)),
    ("chat: n", "POST", "/v1/chat/completions", {"model": "demo", "messages": USER, "n": 2}, "key-a", 400, "n",
     ("not supported",)),
    ("chat: logit_bias", "POST", "/v1/chat/completions", {"model": "demo", "messages": USER, "logit_bias": {"1": 2}},
     "key-a", 400, "logit_bias", ("not supported",)),
    ("chat: image part", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "key-a", 400, "messages[0].content[0].type", ("not supported", "the model demo")),
    ("chat: hosted tool", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": USER, "tools": [{"type": "web_search"}]}, "key-a", 400, "tools[0].type",
     ("web_search", "cannot run")),
    ("chat: invalid tool schema", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                                                     {"type": "objekt"}}}]},
     "key-a", 400, "tools[0]", ()),
    ("chat: required without tools", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": USER, "tool_choice": "required"}, "key-a", 400, "tool_choice", ()),
    ("chat: undeclared tool_choice", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": USER, "tools": [CHAT_FN], "tool_choice": {"type": "function",
                                                                            "function": {"name": "other"}}},
     "key-a", 400, "tool_choice", ()),
    ("chat: json_schema without schema", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": USER, "response_format": {"type": "json_schema"}}, "key-a", 400,
     "response_format", ()),
    ("chat: context too long", "POST", "/v1/chat/completions",
     {"model": "demo", "messages": [{"role": "user", "content": LONG}]}, "key-a", 400, "messages", ("1024", "tokens")),
    ("chat: unknown model", "POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": USER}, "key-a", 404,
     "model", ("gpt-4o",)),
    ("models: unknown", "GET", "/v1/models/gpt-4o", None, "key-a", 404, "model", ("gpt-4o",)),
    # ---- body size and keys ----
    ("oversized response", "POST", "/v1/responses", {"model": "demo", "input": HUGE}, "key-a", 413, None, ()),
    ("oversized chat", "POST", "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content":
                                                                                      HUGE}]}, "key-a", 413, None, ()),
    ("oversized items", "POST", "/v1/conversations", {"items": [{"role": "user", "content": HUGE}]}, "key-a", 413,
     None, ()),
    ("no key", "POST", "/v1/responses", {"model": "demo", "input": "x"}, None, 401, None, ("API key",)),
    ("wrong key", "POST", "/v1/chat/completions", {"model": "demo", "messages": USER}, "key-c", 401, None,
     ("API key",)),
    ("no key: models", "GET", "/v1/models", None, None, 401, None, ()),
    ("wrong key: conversation", "GET", "/v1/conversations/{conv}", None, "nope", 401, None, ()),
]  # fmt: skip


def snapshot(url: str, prefix: str) -> dict[str, Any]:
    """Every key under `prefix` with its value (by type), except counters (and the fence field)."""
    r = redis.Redis.from_url(url)
    out: dict[str, Any] = {}
    for raw in r.scan_iter(match=f"{prefix}:*", count=1000):
        key = raw.decode()
        if key.endswith(COUNTERS) or ":{replicas}:" in key:  # the replica registry: refreshed every second
            continue
        kind = cast(bytes, r.type(key)).decode()
        if kind == "string":
            out[key] = r.get(key)
        elif kind == "hash":  # a conversation's lease fence counter is a field of its hash
            out[key] = {f: v for f, v in r.hgetall(key).items() if f != b"fence"}
        elif kind == "zset":
            out[key] = r.zrange(key, 0, -1, withscores=True)
        elif kind == "list":
            out[key] = r.lrange(key, 0, -1)
        elif kind == "set":
            out[key] = r.smembers(key)
        elif kind == "stream":
            out[key] = r.xrange(key)
    return out


def fill(value: Any, served: Served) -> Any:
    if isinstance(value, str):
        return value.replace("{conv}", served.conv).replace("{resp}", served.resp).replace("{item}", served.item)
    if isinstance(value, list):
        return [fill(v, served) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, served) for k, v in value.items()}
    return value


@pytest.mark.parametrize(("name", "method", "path", "body", "key", "status", "param", "words"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_input(
    served: Served,
    name: str,
    method: str,
    path: str,
    body: Any,
    key: str | None,
    status: int,
    param: str | None,
    words: tuple[str, ...],
) -> None:
    s = served.server
    content = body if isinstance(body, bytes) or body is None else msgspec.json.encode(fill(body, served))
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    before = snapshot(served.redis_url, s.prefix)
    r = httpx.request(method, s.url + fill(path, served), content=content, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    err = r.json().get("error")
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, r.text
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), r.text
    if param is not None:
        assert str(err["param"]).startswith(param), r.text
    for word in words:
        assert word in err["message"], r.text
    if status == 400 and "context" in name:
        assert err["code"] == "context_length_exceeded" and len(re.findall(r"\d+", err["message"])) >= 2, r.text
    if status == 401:
        assert err["code"] == "invalid_api_key", r.text
    assert snapshot(served.redis_url, s.prefix) == before, f"{name}: Redis changed"
    ok = httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer key-a"}, timeout=30)
    assert ok.status_code == 200, ok.text  # still serving


def test_unknown_fields_are_ignored(served: Served) -> None:
    """Clients send fields this server does not know yet: at the top and nested, they are ignored."""
    a = openai.OpenAI(base_url=served.server.url + "/v1", api_key="key-a", max_retries=0, timeout=60)
    new = {"brand_new_field": {"x": [1]}, "another_one": 3}
    items: Any = [{"role": "user", "content": "Hi", "new_item_field": 1}]
    tools: Any = [FN | {"new_tool_field": True}]
    text: Any = {"format": {"type": "text", "new": 1}}
    r = a.responses.create(
        model="demo", input=items, tools=tools, text=text, max_output_tokens=2, temperature=0, store=False,
        extra_body=new,
    )  # fmt: skip
    assert r.status in ("completed", "incomplete")
    conv = a.conversations.create(items=[], extra_body=new)
    assert a.conversations.update(conv.id, metadata={"k": "v"}, extra_body=new).metadata == {"k": "v"}
    added = a.conversations.items.create(conv.id, items=[{"role": "user", "content": "Hi"}], extra_body=new)  # type: ignore[list-item]
    assert len(added.data) == 1
    chat = a.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi", "name_x": 1}],  # type: ignore[list-item,typeddict-unknown-key]
        max_tokens=2, temperature=0, extra_body=new,
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")
    compacted = a.responses.compact(model="demo", input="Hi", extra_body=new)
    assert compacted.output


def test_openapi_schema_is_typed(served: Served) -> None:
    check_schemas_typed(served.server.url)


def test_schemathesis(served: Served) -> None:
    run_schemathesis(served.server.url, {"authorization": "Bearer key-a"})


def test_oversized_body_is_readable_by_a_client_still_sending(served: Served) -> None:
    """A 20 MB body over a 16 KiB limit, sent by urllib (which writes the whole body before it
    reads): the answer is the 413 error object, not a reset connection."""
    body = b'{"model": "demo", "input": "' + b"x" * 20_000_000 + b'"}'
    request = urllib.request.Request(
        served.server.url + "/v1/responses", data=body, method="POST",
        headers={"content-type": "application/json", "authorization": "Bearer key-a"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 413
    err = json.loads(e.value.read())["error"]
    assert err["code"] == "request_too_large" and "16384" in err["message"]
