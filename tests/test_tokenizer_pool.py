"""Tokenization for async callers: same ids as the tokenizer itself, computed off the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from tokenizers import decoders

from engine.tokenizer_pool import TokenizerPool
from tests.test_detokenizer import TEXTS, sentencepiece_like

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def test_same_ids_as_the_tokenizer_and_off_the_loop() -> None:
    tok = sentencepiece_like(decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True))
    tok.hf.chat_template = TEMPLATE
    threads: set[int] = set()
    encode = tok.encode

    def recording(text: str) -> list[int]:
        threads.add(threading.get_ident())
        return encode(text)

    tok.encode = recording  # type: ignore[method-assign]
    messages: list[dict[str, Any]] = [{"role": "user", "content": t} for t in TEXTS[:3]]

    async def main() -> tuple[list[list[int]], list[int], str]:
        with TokenizerPool(tok) as pool:
            encoded = await asyncio.gather(*(pool.encode(t) for t in TEXTS))
            chat = await pool.apply_chat_template(messages)
            text = await pool.decode(encoded[0])
        return list(encoded), chat, text

    encoded, chat, text = asyncio.run(main())
    assert threading.get_ident() not in threads and len(threads) == 1  # one worker, not the loop's thread
    assert encoded == [encode(t) for t in TEXTS]
    assert chat == tok.apply_chat_template(messages)
    assert text == tok.decode(encode(TEXTS[0]))
