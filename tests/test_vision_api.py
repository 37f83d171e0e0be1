"""Images over HTTP with the official `openai` client: `longctx serve` on a tiny random Idefics3
checkpoint (float32) and the shared test Redis. Responses `input_image` and Chat `image_url`
parts as data URLs, streamed and not, answer transformers' greedy text for the same prompt; usage
counts the image's placeholder tokens; a conversation's next turn renders the stored image again
and finds its pages in the prefix cache; an http URL on a loopback server is fetched with
`--allow-private-image-urls`, once: the next turn renders its stored bytes after the URL is
gone; bad, too large and too many images are 400s naming the part. The URL policy itself
(loopback refused without the flag, URLs off by default) is checked on `sessions.image_parts`
against the same loopback server."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import openai
import pytest
import redis

from sessions.config import ImageConfig
from sessions.errors import InvalidParam
from sessions.image_parts import ImageParts, check_image
from sessions.keys import Keys
from tests.server import TEST_KEY, Server, keyed_server
from tests.vision_models import TinyVLM, build_tiny_vlm, image, reference_greedy

QUESTION = "What is in this picture?"
MAX_PIXELS = 10_000  # the test images are 56x40
ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-cache-bytes", "8MB", "--background-workers", "0",
    "--served-model-name", "vlm", "--allow-image-urls", "--allow-private-image-urls", "--max-images", "2",
    "--max-image-pixels", str(MAX_PIXELS), "--max-image-bytes", "100KB",
)  # fmt: skip


def png(seed: int, height: int = 40, width: int = 56, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image(seed, height, width).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class Files(BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}

    def do_GET(self) -> None:  # http.server's name
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "image/gif")
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    """A loopback HTTP server of image files; yields its base URL."""
    Files.files = {"/cat.gif": png(3, fmt="GIF")}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> TinyVLM:
    return build_tiny_vlm("idefics3", tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def server(vlm: TinyVLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with keyed_server(vlm.path, *ARGS, log_dir=tmp_path_factory.mktemp("vision-serve")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)


def expected(t: TinyVLM, picture: bytes, n: int) -> tuple[int, str]:
    """(prompt tokens, transformers' greedy text of n tokens) for a user turn [picture, QUESTION]."""
    tok = t.processor.tokenizer
    ids, images = t.processor.prompt(t.processor.chat_text(tok, QUESTION, 1), [picture], add_special_tokens=False)
    return len(ids), tok.decode(reference_greedy(t, ids, images, n), skip_special_tokens=True)


def user_turn(url: str, kind: str = "responses") -> Any:  # the clients' message params, built as dicts
    if kind == "chat":
        parts = [{"type": "image_url", "image_url": {"url": url, "detail": "low"}}, {"type": "text", "text": QUESTION}]
    else:
        parts = [{"type": "input_image", "image_url": url, "detail": "auto"}, {"type": "input_text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def test_responses_and_chat_answer_as_transformers(vlm: TinyVLM, client: openai.OpenAI) -> None:
    picture = png(1)
    n_prompt, text = expected(vlm, picture, 6)
    url = data_url(picture)
    resp = client.responses.create(model="vlm", input=user_turn(url), temperature=0, max_output_tokens=6)
    assert resp.status == "completed" or resp.incomplete_details is not None
    assert text.startswith(resp.output_text) and len(resp.output_text) > 0
    assert resp.usage is not None and resp.usage.input_tokens == n_prompt  # the image's placeholders counted
    events = client.responses.create(
        model="vlm",
        input=user_turn(url),
        temperature=0,
        max_output_tokens=6,
        stream=True,
    )
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == resp.output_text
    chat = client.chat.completions.create(model="vlm", messages=user_turn(url, "chat"), temperature=0, max_tokens=6)
    assert chat.choices[0].message.content == resp.output_text
    assert chat.usage is not None and chat.usage.prompt_tokens == n_prompt
    chunks = client.chat.completions.create(
        model="vlm",
        messages=user_turn(url, "chat"),
        temperature=0,
        max_tokens=6,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == resp.output_text


def image_keys(server: Server, conv_id: str) -> dict[bytes, int]:
    """The images stored in a conversation's slot (`sessions.image_store`): key -> its bytes' length."""
    assert server.redis_url is not None
    r, match = redis.Redis.from_url(server.redis_url), Keys(server.prefix).image(conv_id, "*")
    return {k: len(r.hget(k, "data") or b"") for k in r.scan_iter(match=match, count=1000)}  # type: ignore[arg-type]


def test_conversation_renders_its_image_again(server: Server, client: openai.OpenAI) -> None:
    """Each turn's prompt holds the earlier turns' images (their pages found again); an image sent
    in three turns is stored once; the conversation's items and each response's input items
    return the part as it was sent; deleting the conversation and its responses deletes it."""
    picture, other = png(2), png(4)
    url = data_url(picture)
    conv = client.conversations.create()
    inputs = [user_turn(url), "And now?", user_turn(url), user_turn(data_url(other))]
    turns = []
    for x in inputs:
        turns.append(client.responses.create(model="vlm", conversation=conv.id, input=x, temperature=0,
                                             max_output_tokens=4))  # fmt: skip
    for before, after in itertools.pairwise(turns):
        assert before.usage is not None and after.usage is not None
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens // 16 * 16 > 0
    assert sorted(image_keys(server, conv.id).values()) == sorted([len(picture), len(other)])  # once each
    items = client.conversations.items.list(conv.id, order="asc").data
    sent = {"type": "input_image", "image_url": url, "detail": "auto"}
    assert items[0].model_dump(exclude_none=True)["content"][0] == sent
    assert items[4].model_dump(exclude_none=True)["content"][0] == sent
    got = client.responses.input_items.list(turns[2].id).data[0].model_dump(exclude_none=True)["content"][0]
    assert got == sent
    client.conversations.delete(conv.id)
    assert len(image_keys(server, conv.id)) == 2  # the responses' input items still point at them
    for t in turns:
        client.responses.delete(t.id)
    assert image_keys(server, conv.id) == {}


def test_image_url_fetched_from_loopback_with_the_flag(
    vlm: TinyVLM, server: Server, client: openai.OpenAI, files: str
) -> None:
    """The URL is fetched once: in a conversation its bytes are stored, and the next turn renders
    them (its pages found again) after the URL has gone; the items still return the URL."""
    gif = png(3, fmt="GIF")
    n_prompt, text = expected(vlm, gif, 4)
    Files.files["/gone.gif"] = gif
    url = files + "/gone.gif"
    conv = client.conversations.create()
    first = client.responses.create(
        model="vlm", conversation=conv.id, input=user_turn(url), temperature=0, max_output_tokens=4
    )
    assert first.usage is not None and first.usage.input_tokens == n_prompt
    assert text.startswith(first.output_text) and first.output_text
    assert list(image_keys(server, conv.id).values()) == [len(gif)]
    del Files.files["/gone.gif"]  # the URL now answers 404
    assert "404" in _bad(client, "/responses", {"model": "vlm", "input": user_turn(url)})["message"]
    second = client.responses.create(
        model="vlm", conversation=conv.id, input="And now?", temperature=0, max_output_tokens=4
    )
    assert second.status == "completed" or second.incomplete_details is not None
    assert second.usage is not None and second.usage.input_tokens > n_prompt + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= n_prompt // 16 * 16 > 0
    sent = {"type": "input_image", "image_url": url, "detail": "auto"}
    items = client.conversations.items.list(conv.id, order="asc").data
    assert items[0].model_dump(exclude_none=True)["content"][0] == sent
    got = client.responses.input_items.list(first.id).data[0].model_dump(exclude_none=True)["content"][0]
    assert got == sent
    client.conversations.delete(conv.id)
    for r in (first, second):
        client.responses.delete(r.id)
    assert image_keys(server, conv.id) == {}


def _bad(client: openai.OpenAI, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        client.post(path, body=body, cast_to=object)
    err = e.value.body
    assert isinstance(err, dict)
    return err


def test_bad_images_are_400_naming_the_part(client: openai.OpenAI, files: str) -> None:
    good = {"type": "input_image", "image_url": data_url(png(1))}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"type": "input_image", "image_url": data_url(b"not a picture")}, "image_url", "not a readable image"),
        ({"type": "input_image", "image_url": "data:image/png;base64,@@@"}, "image_url", "base64"),
        ({"type": "input_image", "image_url": "data:image/png,raw"}, "image_url", "base64"),
        ({"type": "input_image", "file_id": "file-abc"}, "file_id", "not supported"),
        ({"type": "input_image", "image_url": data_url(png(1, 120, 120))}, "image_url", "--max-image-pixels"),
        ({"type": "input_image", "image_url": data_url(bytes(200_000))}, "image_url", "bytes"),
        ({"type": "input_image", "image_url": data_url(png(1, fmt="BMP"))}, "image_url", "BMP"),
        ({"type": "input_image", "image_url": files + "/missing.png"}, "image_url", "404"),
        ({"type": "input_image", "image_url": "ftp://example.invalid/x.png"}, "image_url", "data URL"),
    ]
    for part, field, words in cases:
        body = {"model": "vlm", "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, part]}]}
        err = _bad(client, "/responses", body)
        assert err["param"] == f"input[0].content[1].{field}" and words in err["message"], (part, err)
    too_many = {"model": "vlm", "input": [{"role": "user", "content": [good, good, good]}]}
    assert _bad(client, "/responses", too_many)["param"] == "input[0].content[2]"
    marker = {"model": "vlm", "input": [{"role": "user", "content": [good, {"type": "input_text", "text": "<image>"}]}]}
    assert "image markers" in _bad(client, "/responses", marker)["message"]
    chat = {
        "model": "vlm",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    }
    assert _bad(client, "/chat/completions", chat)["param"] == "messages[0].content[0].image_url.url"
    conv = _bad(client, "/conversations", {"items": [{"role": "user", "content": [{"type": "input_image"}]}]})
    assert conv["param"] == "items[0].content[0].image_url"
    assert client.models.list().data  # still serving


def test_url_policy(files: str) -> None:
    """http(s) URLs only with `allow_urls`; loopback only with `allow_private_urls`."""

    async def read(config: ImageConfig, url: str) -> bytes:
        return await ImageParts(config, "<image>", "m").url_bytes(url, "p")

    url = files + "/cat.gif"
    with pytest.raises(InvalidParam, match="--allow-image-urls"):
        asyncio.run(read(ImageConfig(), url))
    with pytest.raises(InvalidParam, match=r"127\.0\.0\.1, a non-public address.*--allow-private-image-urls"):
        asyncio.run(read(ImageConfig(allow_urls=True), url))
    with pytest.raises(InvalidParam, match="non-public"):
        asyncio.run(read(ImageConfig(allow_urls=True), url.replace("127.0.0.1", "localhost")))
    assert asyncio.run(read(ImageConfig(allow_urls=True, allow_private_urls=True), url)) == Files.files["/cat.gif"]
    with pytest.raises(InvalidParam, match="over 100 bytes"):
        asyncio.run(read(ImageConfig(allow_urls=True, allow_private_urls=True, max_bytes=100), url))
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):  # what Pillow reads of each (a GIF: its first frame)
        check_image(png(1, fmt=fmt), "p", ImageConfig())
    with pytest.raises(InvalidParam, match="TIFF is not supported"):
        check_image(png(1, fmt="TIFF"), "p", ImageConfig())
    with pytest.raises(InvalidParam, match="not a readable image"):
        check_image(png(1)[:200], "p", ImageConfig())  # a truncated PNG: its header reads, its pixels do not
    text_model = ImageParts(ImageConfig(), None, "demo")
    with pytest.raises(InvalidParam, match="the model demo takes no image input"):
        asyncio.run(text_model.chat_messages([{"role": "user", "content": [{"type": "image_url"}]}]))


def test_next_turn_continues_the_last_turns_ids(vlm: TinyVLM) -> None:
    """`image_prompt` with the last turn's prompt + output ids keeps them as they are (the image's
    run included) and tokenizes only the rest, a new image's run spliced in; they equal the
    whole rendering's ids here. Without the previous ids the prompt is built whole."""
    from engine.loading.tokenizer import Tokenizer
    from sessions.image_prompt import image_prompt
    from sessions.items import parse_input
    from sessions.render import encode, render_text, to_messages

    proc, tok = vlm.processor, Tokenizer(vlm.processor.tokenizer)
    first, second = png(1), png(2)
    turn1 = parse_input(user_turn(data_url(first)))
    text1 = render_text(tok, to_messages(turn1, None, proc.marker), [])
    p1 = image_prompt(proc, tok, text1, [first], None)
    assert p1.reused == 0 and len(p1.images) == 1 and p1.images[0].num_tokens > 0
    output = encode(tok, "A red square")
    reply = parse_input([{"role": "assistant", "content": "A red square"}])
    turn2 = parse_input(user_turn(data_url(second)))
    text2 = render_text(tok, to_messages([*turn1, *reply, *turn2], None, proc.marker), [])
    p2 = image_prompt(proc, tok, text2, [first, second], [*p1.ids, *output])
    assert p2.reused == len(p1.ids) + len(output) and p2.ids[: p2.reused] == [*p1.ids, *output]
    whole = image_prompt(proc, tok, text2, [first, second], None)
    assert whole.reused == 0 and whole.ids == p2.ids
    assert [im.content_hash for im in p2.images] == [im.content_hash for im in whole.images]
    assert p2.images[0].content_hash == p1.images[0].content_hash != p2.images[1].content_hash
    with pytest.raises(InvalidParam, match="2 image markers"):
        image_prompt(proc, tok, text1 + proc.marker, [first], None)
