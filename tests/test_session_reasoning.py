"""A reasoning model through the session service: a tiny random Qwen3 with the demo tokenizer and a
Qwen3-style `<think>` template whose generation prompt opens the reasoning. What it writes before
`</think>` is a `reasoning` item (counted in `reasoning_tokens`), never message text; with
`reasoning.effort: "none"` the template's thinking switch is off and the reply is message text."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.engine import Engine, EngineConfig
from engine.loading.tokenizer import Tokenizer
from sessions.items import Message, Reasoning, parse_input
from sessions.requests import InvalidParam
from sessions.sealed import Sealer, open_reasoning
from sessions.service import SessionService
from sessions.store import SessionStore, StoreConfig
from tests.redis_server import shared_redis
from tests.session_engine import whole
from tests.structured_demo import DEMO_VOCAB, compiler
from tests.tiny_models import build_tiny, one_thread
from tools.formats import detect_format

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)

_threads = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module")
def service_parts(tmp_path_factory: pytest.TempPathFactory, demo_gguf: Path) -> Iterator[tuple[Engine, Tokenizer]]:
    demo = compiler(str(demo_gguf)).tokenizer
    hf = copy.deepcopy(demo.hf)
    hf.chat_template = THINKING
    tok = Tokenizer(hf, demo.eos_token_ids)
    tiny = build_tiny(Qwen3Config, Qwen3ForCausalLM, tmp_path_factory.mktemp("qwen3"), vocab_size=DEMO_VOCAB)
    engine = Engine(tiny.model, tok, EngineConfig(kv_cache_bytes=1 << 24, attention_backend="torch_paged")).start()
    yield engine, tok
    engine.shutdown()


def test_reasoning_item_and_thinking_switch(service_parts: tuple[Engine, Tokenizer], demo_gguf: Path) -> None:
    engine, tok = service_parts

    async def main() -> None:
        with shared_redis() as (url, prefix):
            store = SessionStore.connect(url, StoreConfig(prefix=prefix))
            svc = SessionService(engine, store, tok, compiler(str(demo_gguf)), detect_format(tok))
            try:
                body = {"input": "Hi", "temperature": 0, "max_output_tokens": 12}
                r = await whole(svc.create("t", body))
                # a random model never closes </think>: everything it wrote is reasoning
                assert [type(i) for i in r.output] == [Reasoning] and r.output[0].content[0].text  # type: ignore[union-attr]
                assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12  # type: ignore[union-attr]
                off = await whole(svc.create("t", body | {"reasoning": {"effort": "none"}}))
                assert [type(i) for i in off.output] == [Message] and off.reasoning.effort == "none"  # type: ignore[union-attr]
                assert off.usage.output_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]
            finally:
                await store.close()

    asyncio.run(main())


def test_encrypted_reasoning_round_trip(service_parts: tuple[Engine, Tokenizer], demo_gguf: Path) -> None:
    """`include: ["reasoning.encrypted_content"]` with `store: false`: the reasoning item carries its
    text sealed (AES-GCM under the key in Redis); sent back with only that, it is opened; altered,
    or sent by another tenant, it is a 400 naming its `encrypted_content`."""
    engine, tok = service_parts

    async def main() -> None:
        with shared_redis() as (url, prefix):
            store = SessionStore.connect(url, StoreConfig(prefix=prefix))
            svc = SessionService(engine, store, tok, compiler(str(demo_gguf)), detect_format(tok))
            try:
                body = {"input": "Hi", "temperature": 0, "max_output_tokens": 8, "store": False,
                        "include": ["reasoning.encrypted_content"]}  # fmt: skip
                r = await whole(svc.create("t", body))
                (item,) = r.output
                assert isinstance(item, Reasoning) and isinstance(item.encrypted_content, str)
                text = item.content[0].text
                assert text not in item.encrypted_content and item.encrypted_content.startswith("lcr1.")
                sealed: dict[str, Any] = {
                    "type": "reasoning",
                    "id": item.id,
                    "summary": [],
                    "encrypted_content": item.encrypted_content,
                }
                back = [sealed, {"role": "user", "content": "Go on"}]
                items = parse_input(back)
                open_reasoning(items, Sealer(await store.reasoning_key(), "t"))
                assert items[0].content[0].text == text  # type: ignore[union-attr]
                assert (await whole(svc.create("t", body | {"input": back}))).status in ("completed", "incomplete")
                forged = [{**back[0], "encrypted_content": item.encrypted_content[:-4] + "AAAA"}, back[1]]
                for tenant, sent in (("t", forged), ("other", back)):
                    with pytest.raises(InvalidParam) as e:
                        await whole(svc.create(tenant, body | {"input": sent}))
                    assert e.value.param == "input[0].encrypted_content"
            finally:
                await store.close()

    asyncio.run(main())
