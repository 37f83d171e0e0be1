"""Compaction and truncation over HTTP with the `openai` client: `longctx serve` on the demo model
(float32, greedy) and the shared test Redis, one server for the module (with `--api-keys-file`).
A small KV cache (64 MiB, about 1400 tokens) makes the context limit reachable for the
truncation test."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import openai
import pytest

from sessions.compaction import SUMMARY_MAX_TOKENS, SUMMARY_PROMPT
from tests.server import TEST_KEY, Server, demo_args, keyed_server

ARGS = demo_args("64MiB", 0)
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}
STORY = (
    "My name is Ada and I keep bees on a farm near Lyon. Last spring we had forty hives, and the clover "
    "honey sold out at the market in two weeks. This year the plan is sixty hives, a new extractor, and "
    "a small shop by the road where visitors can taste three kinds of honey. "
)


@pytest.fixture(scope="module")
def server(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with keyed_server(demo_gguf, *ARGS, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=300)


def summary_of(encrypted_content: str) -> dict[str, Any]:
    """The signed payload of our compaction item (readable, not secret)."""
    body = encrypted_content.split(".")[1]
    payload: dict[str, Any] = json.loads(base64.urlsafe_b64decode(body))
    return payload


def as_input(item: Any) -> Any:
    return {"role": item.role, "content": item.content[0].text}


def test_compaction_summarises_older_turns(client: openai.OpenAI) -> None:
    conv = client.conversations.create(items=[])
    for text in (STORY * 2 + "What do I keep?", "How many hives this year?"):
        client.responses.create(model="demo", conversation=conv.id, input=text, **GREEDY)
    before = client.conversations.items.list(conv.id, order="asc").data
    full = client.responses.create(
        model="demo", input=[*map(as_input, before), {"role": "user", "content": "Where is the farm?"}],
        store=False, **GREEDY,
    )  # fmt: skip
    third = client.responses.create(
        model="demo", conversation=conv.id, input="Where is the farm?",
        context_management=[{"type": "compaction", "compact_threshold": 120}], **GREEDY,  # type: ignore[list-item]
    )  # fmt: skip
    assert third.status == "completed" and third.output[0].type == "compaction"
    assert third.usage is not None and full.usage is not None
    assert third.usage.input_tokens < full.usage.input_tokens
    payload = summary_of(third.output[0].encrypted_content)  # type: ignore[union-attr]
    assert payload["keep_from"] == before[2].id  # the second-last user message on stays verbatim
    replay = client.responses.create(
        model="demo", input=[*map(as_input, before[:2]), {"role": "user", "content": SUMMARY_PROMPT}],
        temperature=0, max_output_tokens=SUMMARY_MAX_TOKENS, store=False,
    )  # fmt: skip
    assert payload["summary"] and replay.output_text == payload["summary"]
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.id for i in items[:5]] == [i.id for i in before] + [items[4].id]
    assert [i.type for i in items] == ["message"] * 5 + ["compaction", "message"]
    fourth = client.responses.create(model="demo", conversation=conv.id, input="Thanks!", **GREEDY)
    history: Any = [*map(as_input, [i for i in items if i.type == "message"]), {"role": "user", "content": "Thanks!"}]
    whole = client.responses.create(model="demo", input=history, store=False, temperature=0, max_output_tokens=1)
    assert fourth.usage is not None and whole.usage is not None
    assert fourth.usage.input_tokens < whole.usage.input_tokens


def test_compact_endpoint_and_foreign_items(client: openai.OpenAI) -> None:
    turns = [
        {"role": "user", "content": STORY + "What do I keep?"},
        {"role": "assistant", "content": "You keep bees."},
        {"role": "user", "content": "How many hives?"},
        {"role": "assistant", "content": "Sixty this year."},
        {"role": "user", "content": "Where?"},
    ]
    compacted = client.responses.compact(model="demo", input=turns)  # type: ignore[arg-type]
    assert compacted.object == "response.compaction"
    assert [o.type for o in compacted.output] == ["compaction", "message", "message", "message"]
    assert compacted.usage is not None and compacted.usage.output_tokens > 0
    follow = client.responses.create(
        model="demo",
        input=[cast(Any, o.model_dump(exclude_none=True)) for o in compacted.output],
        store=False,
        **GREEDY,
    )
    assert follow.status == "completed"
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses/compact", body={"input": turns}, cast_to=object)
    assert e.value.body["param"] == "model"  # type: ignore[index]
    forged = {"type": "compaction", "encrypted_content": "lc1.eyJzdW1tYXJ5IjoieCJ9.00"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="demo", input=[forged, turns[0]], **GREEDY)  # type: ignore[list-item]
    assert e.value.body["param"] == "input[0].encrypted_content"  # type: ignore[index]


def test_truncation_drops_whole_turns(client: openai.OpenAI) -> None:
    rules = {"role": "developer", "content": "Answer in one short sentence."}
    call = {"type": "function_call", "call_id": "call_1", "name": "hives", "arguments": "{}"}
    turns = [
        [{"role": "user", "content": STORY * 2 + "Count my hives."}, call,
         {"type": "function_call_output", "call_id": "call_1", "output": "60"},
         {"role": "assistant", "content": "Sixty."}],
        [{"role": "user", "content": STORY * 2 + "What honey?"}, {"role": "assistant", "content": "Clover."}],
        [{"role": "user", "content": STORY + "Which city?"}, {"role": "assistant", "content": "Lyon."}],
    ]  # fmt: skip
    items: Any = [rules, *(i for t in turns for i in t)]
    conv = client.conversations.create(items=items)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="demo", conversation=conv.id, input="And?", temperature=0, max_output_tokens=4000)
    assert e.value.code == "context_length_exceeded"
    numbers = [int(n) for n in re.findall(r"\d+", str(e.value.body["message"]))]  # type: ignore[index]
    limit = numbers[-1]
    sizes = []  # prompt tokens of the context without its oldest k turns
    for k in range(len(turns)):
        kept = [rules, *(i for t in turns[k:] for i in t), {"role": "user", "content": "And?"}]
        r = client.responses.create(model="demo", input=kept, store=False, temperature=0, max_output_tokens=1)  # type: ignore[arg-type]
        assert r.usage is not None
        sizes.append(r.usage.input_tokens)
    ask = limit - (sizes[1] + sizes[2]) // 2  # fits without the two oldest turns, not without only one
    assert sizes[2] + ask <= limit < sizes[1] + ask
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="demo", conversation=conv.id, input="And?", temperature=0, max_output_tokens=ask)
    auto = client.responses.create(
        model="demo", conversation=conv.id, input="And?", temperature=0, max_output_tokens=ask, truncation="auto"
    )
    assert auto.status in ("completed", "incomplete") and auto.usage is not None
    assert auto.usage.input_tokens == sizes[2]  # the two oldest turns dropped, whole


def test_shortened_tool_outputs_stay_shortened_so_the_next_turn_reuses_the_kv(client: openai.OpenAI) -> None:
    """Past the threshold, old tool outputs are shortened; the next turn shortens the same ones
    (not the ones its later boundary would allow), so its prompt continues the previous prompt
    and its KV is reused: `cached_tokens` covers the whole previous prompt, rounded to pages."""
    log = "".join(f"hive {i}: {10 + i % 7} kg of clover honey, the queen is laying well.\n" for i in range(24))

    def call(n: int) -> list[dict[str, str]]:
        return [
            {"type": "function_call", "call_id": f"call_{n}", "name": "read_log", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"call_{n}", "output": log.replace("hive", f"log {n} hive")},
        ]

    history = [
        {"role": "user", "content": "Read the first log."}, *call(1), {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Read the second log."}, *call(2), {"role": "assistant", "content": "Done."},
    ]  # fmt: skip
    conv = client.conversations.create(items=history)  # type: ignore[arg-type]
    ask = {"role": "user", "content": "Which hive is best?"}
    full = client.responses.create(model="demo", input=[*history, ask], store=False, temperature=0, max_output_tokens=1)  # type: ignore[list-item]
    assert full.usage is not None
    rule: Any = [{"type": "compaction", "compact_threshold": full.usage.input_tokens - 100}]
    third = client.responses.create(
        model="demo", conversation=conv.id, input=ask["content"], context_management=rule, **GREEDY
    )
    assert third.usage is not None and third.output[0].type != "compaction"
    assert third.usage.input_tokens < full.usage.input_tokens - 100  # the first log was shortened
    fourth = client.responses.create(
        model="demo", conversation=conv.id, input="And the worst?", context_management=rule, **GREEDY
    )
    assert fourth.usage is not None and fourth.output[0].type != "compaction"
    page = 16
    assert fourth.usage.input_tokens_details.cached_tokens >= third.usage.input_tokens // page * page
