"""What agent harnesses send, over `longctx serve` with the YaRN override to 32k
(`--hf-overrides`): the Codex CLI's recorded first request (`tests/data/codex/`) through raw HTTP
and the `openai` client, and its next turn re-sent whole (`store: false`), on the tiny Llama with
the demo tokenizer; on the demo model: namespace, custom (Lark and regex, OpenAI's documented
examples) and hosted tools; compaction; the SSE content type of every streaming route; WebSocket
mode (`api.ws`) as the Open Responses suite drives it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect

from engine.loading.gguf_cache import GGUFCache
from tests.cores import THREADS_ARG
from tests.server import TEST_KEY, Server, keyed_server

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data" / "codex"
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 32768}  # fmt: skip
ARGS = ("--threads", THREADS_ARG, "--kv-cache-bytes", "768MiB", "--max-output-tokens", "40",
        "--background-workers", "1", "--served-model-name", "demo", "--hf-overrides", json.dumps(YARN),
        "--override-generation-config", '{"temperature": 0}')  # fmt: skip
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}
ENDED = ("response.completed", "response.incomplete")  # a reply may reach the output cap
AUTH = {"authorization": f"Bearer {TEST_KEY}"}
# OpenAI's documented grammar examples for custom tools (function-calling guide, "Context-free grammars")
MATH_LARK = """start: expr
expr: term (SP ADD SP term)* -> add
| term
term: factor (SP MUL SP factor)* -> mul
| factor
factor: INT
SP: " "
ADD: "+"
MUL: "*"
%import common.INT"""
TIMESTAMP_REGEX = (r"^(?P<month>January|February|March|April|May|June|July|August|September|October|November|"
                   r"December)\s+(?P<day>\d{1,2})(?:st|nd|rd|th)?\s+(?P<year>\d{4})\s+at\s+(?P<hour>0?[1-9]|1[0-2])"
                   r"(?P<ampm>AM|PM)$")  # fmt: skip


@pytest.fixture(scope="module")
def server(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with keyed_server(demo_gguf, *ARGS, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def codex_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same arguments on the tiny Llama with the demo tokenizer: the Codex request's checks are
    of the protocol (its ~10k tokens read as the demo model reads them), not of what the model
    answers, and its prefill takes a second there instead of one to two minutes on one thread."""
    with keyed_server(tiny_model, *ARGS, log_dir=tmp_path_factory.mktemp("codex-logs")) as s:
        yield s


def codex_body() -> dict[str, Any]:
    body: dict[str, Any] = json.loads((DATA / "first-request.json").read_text())
    return body


def codex_headers() -> dict[str, str]:
    lines = (DATA / "first-request.headers.txt").read_text().splitlines()
    skip = {"host", "content-length", "authorization"}
    pairs = (line.split(": ", 1) for line in lines if ": " in line)
    return {k: v for k, v in pairs if k not in skip} | AUTH


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert event["type"] == name
            events.append(event)
    return events


def test_codex_first_request_over_raw_http_then_resent_whole(codex_server: Server) -> None:
    body = codex_body()
    with httpx.stream("POST", codex_server.url + "/v1/responses", json=body, headers=codex_headers(), timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ENDED
    final = events[-1]["response"]
    assert [t["type"] for t in final["tools"]] == [t["type"] for t in body["tools"]]
    space = next(t for t in final["tools"] if t["type"] == "namespace")
    assert space["name"] == "multi_agent_v1" and space["tools"][0]["name"] == "close_agent"
    assert final["store"] is False and final["prompt_cache_key"] == body["prompt_cache_key"]
    assert final["temperature"] == 0  # Codex sends none: the server's default (--override-generation-config)
    assert final["reasoning"] == {"effort": "low", "summary": "auto"} and final["usage"]["input_tokens"] > 8192
    # the next turn, as `codex exec resume` sends it: the whole history again, store false
    body["input"] += [*final["output"], {"type": "message", "role": "user",
                                         "content": [{"type": "input_text", "text": "And then?"}]}]  # fmt: skip
    again = httpx.post(codex_server.url + "/v1/responses", json=body | {"stream": False}, headers=AUTH, timeout=300)
    assert again.status_code == 200, again.text
    usage = again.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0.95 * usage["input_tokens"], usage


def test_codex_first_request_through_the_openai_client(codex_server: Server) -> None:
    client = openai_client(codex_server)
    body = codex_body()
    extra = {k: body.pop(k) for k in ("client_metadata",)}  # fields this client version does not name
    headers = {k: v for k, v in codex_headers().items() if k.startswith(("x-codex", "session", "thread", "originator"))}
    stream = client.responses.create(**body, extra_body=extra, extra_headers=headers)
    types = [e.type for e in stream]  # type: ignore[union-attr]
    assert types[0] == "response.created" and types[-1] in ENDED


def test_namespace_tool_call_and_its_output(client: openai.OpenAI) -> None:
    tools: Any = [next(t for t in codex_body()["tools"] if t["type"] == "namespace"), {"type": "web_search"}]
    choice: Any = {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}
    r = client.responses.create(model="demo", input="Start a helper agent.", tools=tools, tool_choice=choice,  # type: ignore[arg-type]
                                temperature=0, max_output_tokens=40, store=False)  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "spawn_agent"
    assert call.model_dump().get("namespace") == "multi_agent_v1"
    assert [t.type for t in r.tools] == ["namespace", "web_search"]
    made = {"type": "function_call", "call_id": call.call_id, "name": "spawn_agent", "namespace": "multi_agent_v1",
            "arguments": call.arguments}  # fmt: skip
    back = [made, {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]
    done = client.responses.create(model="demo", input=back, tools=tools, store=False, **GREEDY)  # type: ignore[arg-type]
    assert done.status in ("completed", "incomplete")


def test_custom_tools_under_lark_and_regex(client: openai.OpenAI) -> None:
    lark: Any = {"type": "custom", "name": "math_exp", "description": "an arithmetic expression",
            "format": {"type": "grammar", "syntax": "lark", "definition": MATH_LARK}}  # fmt: skip
    regex: Any = {"type": "custom", "name": "timestamp", "description": "when",
             "format": {"type": "grammar", "syntax": "regex", "definition": TIMESTAMP_REGEX}}  # fmt: skip
    with client.responses.stream(model="demo", input="Add four and four.", tools=[lark, regex],  # type: ignore[list-item]
                                 tool_choice={"type": "custom", "name": "math_exp"}, temperature=0,
                                 max_output_tokens=40) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "custom_tool_call" and call.name == "math_exp"
    assert re.fullmatch(r"\d+( [+*] \d+)*", call.input), call.input
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")  # type: ignore[union-attr]
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert deltas == done.input == call.input  # type: ignore[union-attr]
    when = client.responses.create(model="demo", input="When is the meeting?", tools=[lark, regex],  # type: ignore[list-item]
                                   tool_choice={"type": "custom", "name": "timestamp"}, temperature=0,
                                   max_output_tokens=40)  # fmt: skip
    (call2,) = when.output
    assert call2.type == "custom_tool_call" and re.fullmatch(TIMESTAMP_REGEX, call2.input), call2.input  # type: ignore[union-attr]
    answer = client.responses.create(
        model="demo", previous_response_id=when.id, tools=[lark, regex],  # type: ignore[list-item]
        input=[{"type": "custom_tool_call_output", "call_id": call2.call_id, "output": "noted"}], **GREEDY,  # type: ignore[union-attr]
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete")


def test_compact_always_returns_a_compaction_item(client: openai.OpenAI) -> None:
    compacted = client.responses.compact(model="demo", input="Hi")
    assert compacted.output[0].type == "compaction" and compacted.output[1].type == "message"
    again: Any = [*(i.model_dump() for i in compacted.output), {"role": "user", "content": "Go on"}]
    nxt = client.responses.create(model="demo", input=again, **GREEDY)
    assert nxt.status in ("completed", "incomplete")


def test_every_streaming_route_is_an_event_stream(server: Server, client: openai.OpenAI) -> None:
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 2}
    resp = {"model": "demo", "input": "Hi", "stream": True, "max_output_tokens": 2}
    queued = client.responses.create(model="demo", input="Hi", background=True, max_output_tokens=2)
    for method, path, body in (("POST", "/v1/chat/completions", chat), ("POST", "/v1/responses", resp),
                               ("GET", f"/v1/responses/{queued.id}?stream=true", None)):  # fmt: skip
        with httpx.stream(method, server.url + path, json=body, headers=AUTH, timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), path
            r.read()


def test_the_override_is_not_written_into_the_gguf_cache(client: openai.OpenAI, demo_gguf: Path) -> None:
    assert client.models.list().data[0].model_dump()["max_model_len"] == 32768
    cached = GGUFCache(demo_gguf).config()
    assert cached is not None and cached.max_position_embeddings == 8192 and cached.rope.type == "default"


# ---- WebSocket mode: the seven cases of the Open Responses suite ----


def ws(server: Server) -> Any:
    return connect(server.url.replace("http://", "ws://") + "/v1/responses", additional_headers=AUTH,
                   open_timeout=30, max_size=None)  # fmt: skip


def create(socket: Any, **body: Any) -> list[dict[str, Any]]:
    """One `response.create`: its events up to the terminal one (or the one error event)."""
    socket.send(json.dumps({"type": "response.create", "model": "demo", **GREEDY, **body}))
    events = []
    while True:
        event = json.loads(socket.recv(timeout=300))
        events.append(event)
        if event["type"] in ("error", "response.failed", *ENDED):
            return events


def test_ws_one_and_sequential_responses(server: Server) -> None:
    with ws(server) as socket:
        first = create(socket, input="Say hi.")
        assert first[0]["type"] == "response.created" and first[-1]["type"] in ENDED
        assert [e["sequence_number"] for e in first] == list(range(len(first)))
        second = create(socket, input="Count to three.")
        assert second[-1]["type"] in ENDED and second[-1]["response"]["id"] != first[-1]["response"]["id"]


def test_ws_continuations_stored_and_connection_local(server: Server) -> None:
    with ws(server) as socket:
        stored = create(socket, input="My name is Ada.")[-1]["response"]
        nxt = create(socket, input="What is my name?", previous_response_id=stored["id"])
        assert nxt[-1]["type"] in ENDED
        local = create(socket, input="My name is Bo.", store=False)[-1]["response"]
        cont = create(socket, input="What is my name?", previous_response_id=local["id"], store=False)
        assert cont[-1]["type"] in ENDED
        assert cont[-1]["response"]["usage"]["input_tokens"] > local["usage"]["input_tokens"]
    with ws(server) as socket:  # a new connection knows nothing of the store:false chain
        (error,) = create(socket, input="Again?", previous_response_id=cont[-1]["response"]["id"], store=False)
        assert error["type"] == "error" and error["error"]["code"] == "previous_response_not_found"
        history = [
            {"role": "user", "content": "My name is Bo."},
            *local["output"],
            {"role": "user", "content": "Again?"},
        ]
        assert create(socket, input=history, store=False)[-1]["type"] in ENDED  # recovered


def test_ws_unknown_previous_response_and_a_failed_continuation(server: Server) -> None:
    with ws(server) as socket:
        (error,) = create(socket, input="x", previous_response_id="resp_never")
        assert error["error"]["code"] == "previous_response_not_found" and error["status"] == 400
        local = create(socket, input="Hello.", store=False)[-1]["response"]
        bad = [{"type": "function_call_output", "call_id": "call_none", "output": "x"}]
        (failed,) = create(socket, input=bad, previous_response_id=local["id"], store=False)
        assert failed["type"] == "error" and failed["error"]["param"] == "input[0].call_id"
        (evicted,) = create(socket, input="Hello again.", previous_response_id=local["id"], store=False)
        assert evicted["error"]["code"] == "previous_response_not_found"  # the failure evicted it
        socket.send(json.dumps({"type": "response.cancel"}))
        assert json.loads(socket.recv(timeout=60))["error"]["param"] == "type"


def test_ws_compaction_starts_a_new_chain(server: Server, client: openai.OpenAI) -> None:
    with ws(server) as socket:
        local = create(socket, input="Remember: blue.", store=False)[-1]["response"]
        compacted = client.responses.compact(model="demo", input=[{"role": "user", "content": "Remember: blue."},
                                                                  *local["output"]])  # fmt: skip
        fresh = [*(i.model_dump() for i in compacted.output), {"role": "user", "content": "Which colour?"}]
        started = create(socket, input=fresh, store=False)[-1]["response"]
        assert started["previous_response_id"] is None
        cont = create(socket, input="Sure?", previous_response_id=started["id"], store=False)
        assert cont[-1]["type"] in ENDED
