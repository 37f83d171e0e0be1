"""The Responses and Conversations APIs over HTTP with the official `openai` client: `longctx serve`
on the demo model (float32, greedy) and the shared test Redis, started with `--api-keys-file` (the
client sends its key). Turns by `conversation` and by
`previous_response_id`, a streamed reply, a tool round trip, `responses.parse` with a Pydantic
model, the Conversations API as the Agents SDK pages it, errors as OpenAI's error object."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.server import TEST_KEY, Server, demo_args, keyed_server

ARGS = demo_args("256MiB", 1)
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 24}
WEATHER: Any = {
    "type": "function", "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def server(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with keyed_server(demo_gguf, *ARGS, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)


def test_turns_by_conversation_and_previous_response_id(client: openai.OpenAI) -> None:
    conv = client.conversations.create(items=[])
    question = "What is the capital of France?"
    first = client.responses.create(model="demo", conversation=conv.id, input=question, **GREEDY)
    assert first.status == "completed" and "Paris" in first.output_text
    second = client.responses.create(model="demo", conversation=conv.id, input="And of Germany?", **GREEDY)
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= 32
    items = client.conversations.items.list(conv.id, order="asc")
    assert len(items.data) == 4 and not items.has_more
    chained = client.responses.create(model="demo", previous_response_id=first.id, input="And of Germany?", **GREEDY)
    assert chained.output_text == second.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text
    assert [i.type for i in client.responses.input_items.list(second.id).data] == ["message"]


def test_stream_and_tool_round_trip(client: openai.OpenAI) -> None:
    with client.responses.stream(model="demo", input="What is the weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                 tool_choice="required", parallel_tool_calls=False, temperature=0,
                                 max_output_tokens=40) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and "Paris" in call.arguments
    answer = client.responses.create(
        model="demo", previous_response_id=final.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}], **GREEDY,
    )  # fmt: skip
    assert answer.status == "completed" and answer.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="demo", previous_response_id=final.id,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        )  # fmt: skip
    assert e.value.body["param"] == "input[0].call_id"  # type: ignore[index]


class City(BaseModel):
    name: str
    country: str


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model="demo", input="Name a city in France.", text_format=City, temperature=0, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_errors_are_openai_error_objects(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oracle: Any = {"type": "oracle"}
        client.responses.create(model="demo", input="x", tools=[oracle])
    assert e.value.body["param"] == "tools[0].type"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list("conv_unknown")
