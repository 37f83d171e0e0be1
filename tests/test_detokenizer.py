"""Streaming detokenization and stop strings: the streamed text must be the text `decode` gives for
all output ids, never half a character, never a stop string, and never held longer than needed.

Two tokenizers: the demo model's (SmolLM2, byte-level BPE: a CJK character or emoji is split
across ids) and tiny sentencepiece-style BPEs built here with byte fallback (`<0xE4>` ids) and a
Metaspace pre-tokenizer, once with Llama's decoder (Strip) and once with the Metaspace decoder.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.loading.model_source import DEMO_MODEL, resolve_model
from engine.loading.tokenizer import Tokenizer
from engine.sampling.detokenizer import IncrementalDetokenizer, StopChecker

TEXTS = [
    "Hello, world!",
    "Héllo naïve café — résumé, Ça va? ñ ü ß",
    "日本語のテキストを書いています。東京は大きな都市です。",
    "这是一个中文句子，我们正在测试流式解码。",
    "한국어 텍스트입니다",
    "emoji 🎉 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 rainbow 🏳️\u200d🌈 skin 👍🏽",
    "mixed: a世b🎉c é\n\tnew  lines   and  spaces",
    "  leading spaces and trailing ",
    "Ελληνικά και русский текст, नमस्ते दुनिया",
]
SPECIAL = ["<unk>", "<s>", "</s>"]
# Everything else (emoji, most CJK, ñ, newlines) falls back to <0xXX> byte ids.
ALPHABET = "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789,.!?'-éï日本語のテキスト"
MERGES = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("l", "l"), ("ll", "o"), ("▁", "w"), ("o", "r"), ("▁w", "or")]
MERGES += [("ス", "ト"), ("テ", "キ"), ("テキ", "スト"), ("▁", "日"), ("▁日", "本")]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def sentencepiece_like(decoder: decoders.Decoder) -> Tokenizer:
    """A Llama-style BPE built by hand (trainers break ties at random): Metaspace, byte fallback."""
    pieces = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + list(ALPHABET) + [a + b for a, b in MERGES]
    bpe = models.BPE({p: i for i, p in enumerate(pieces)}, MERGES, unk_token="<unk>", byte_fallback=True)
    rust = RustTokenizer(bpe)
    rust.add_special_tokens(SPECIAL)
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    rust.decoder = decoder
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def smollm(demo_gguf: Path) -> Tokenizer:
    return Tokenizer.load(resolve_model(DEMO_MODEL))


@pytest.fixture(scope="module")
def llama_like() -> Tokenizer:
    strip = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    return sentencepiece_like(decoders.Sequence(strip))


@pytest.fixture(scope="module")
def metaspace_like() -> Tokenizer:
    return sentencepiece_like(decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="always")]))


@pytest.fixture(params=["smollm", "llama_like", "metaspace_like"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.hf.encode(text, add_special_tokens=False))


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """Streams `ids` one at a time, checking after each that the text is exactly what decode gives
    for the ids so far, whenever those end on a whole character; returns the deltas, flush last."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens)
    deltas = []
    for n, token_id in enumerate(ids, 1):
        deltas.append(detok.add(token_id))
        so_far = tokenizer.decode(ids[:n], skip_special_tokens)
        if not so_far.endswith("\ufffd"):
            assert "".join(deltas) == so_far, f"after {n} ids"
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streams_multilingual_text_exactly(tokenizer: Tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids).strip() == text.strip()  # the tokenizer round-trips it (up to sentencepiece's spaces)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_the_tokenizers_split_characters(smollm: Tokenizer, llama_like: Tokenizer) -> None:
    """The UTF-8 tests mean something only if characters really span several ids."""
    text = "世界 😀"
    assert any("\ufffd" in smollm.decode([i]) for i in encode(smollm, text))
    assert {"<0xE4>", "<0xF0>"} <= set(llama_like.hf.convert_ids_to_tokens(encode(llama_like, text)))


def test_sentencepiece_spaces_come_from_context(llama_like: Tokenizer) -> None:
    ids = encode(llama_like, "the lazy dog")
    assert "".join(llama_like.decode([i]) for i in ids) == "thelazydog"  # what one-id decoding gives
    assert "".join(stream(llama_like, ids)) == "the lazy dog"


def test_emoji_arrives_whole_in_one_delta(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "a 🎉 b")
    deltas = stream(tokenizer, ids)
    assert any("🎉" in d for d in deltas)
    assert len(ids) > 3  # the emoji took several ids, yet no delta holds part of it


def test_characters_completed_mid_id_stream_at_once() -> None:
    """A byte-level vocabulary whose ids all straddle characters (each completes one and starts the
    next), so no id boundary is a character boundary: each character must still come out as it completes."""
    text = "日本語のテキストを書く"
    as_bytes = "".join(p for p, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text))
    pieces = [as_bytes[:1]] + [as_bytes[i : i + 3] for i in range(1, len(as_bytes), 3)]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    ids = [vocab.setdefault(p, len(vocab)) for p in pieces]
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.decoder = decoders.ByteLevel()
    tokenizer = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust))
    assert all("\ufffd" in tokenizer.decode(ids[:n]) for n in range(1, len(ids)))
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(i) for i in ids] == ["", *text]
    assert detok.flush() == ""


def test_incomplete_character_is_held_then_flushed(smollm: Tokenizer) -> None:
    ids = encode(smollm, "ok 🎉")
    partial = ids[:-1]  # the emoji's last byte never comes
    assert smollm.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(smollm, [])
    emitted = "".join(detok.add(i) for i in partial)
    assert emitted == "ok "  # the space shares an id with the emoji's first bytes, yet is whole
    assert emitted + detok.flush() == smollm.decode(partial)
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = [eos, *encode(tokenizer, "hi there"), eos, eos, *encode(tokenizer, " 世界"), eos]
    text = "".join(stream(tokenizer, ids, skip))
    assert text == tokenizer.decode(ids, skip)
    assert (tokenizer.hf.eos_token in text) is not skip


@pytest.mark.parametrize(
    "pieces",
    [
        ["<unk>", "▁", "▁", "a"],
        ["▁", "<s>", "▁wor", "d"],
        ["▁", "</s>", "</s>", "▁", "<s>", "▁the"],
        ["<s>", "▁the", "</s>", "▁"],
    ],
)
@pytest.mark.parametrize("name", ["llama_like", "metaspace_like"])
@pytest.mark.parametrize("skip", [True, False])
def test_stripped_first_space_survives_special_tokens(
    request: pytest.FixtureRequest, name: str, pieces: list[str], skip: bool
) -> None:
    """Sentencepiece decoders strip the first space of the text; skipped special tokens around a
    leading "▁" must not move which space that is."""
    tokenizer: Tokenizer = request.getfixturevalue(name)
    ids = tokenizer.hf.convert_tokens_to_ids(pieces)
    assert "".join(stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip)


class CountingTokenizer(Tokenizer):
    """Records the longest id list any decode call received."""

    longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("name", ["smollm", "llama_like"])
def test_cost_per_id_does_not_grow_with_length(request: pytest.FixtureRequest, name: str) -> None:
    base: Tokenizer = request.getfixturevalue(name)
    counting = CountingTokenizer(base.hf)
    ids = encode(base, " ".join(TEXTS) * 10)
    ids += [base.eos_token_ids[0]] * 200 + ids  # a run of skipped special tokens must not widen the window
    detok = IncrementalDetokenizer(counting, [])
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == base.decode(ids)
    assert len(ids) > 2000
    assert counting.longest <= 10


def test_garbage_bytes_do_not_grow_the_window(llama_like: Tokenizer) -> None:
    counting = CountingTokenizer(llama_like.hf)
    lead = llama_like.hf.convert_tokens_to_ids("<0xE4>")  # starts a 3-byte character that never completes
    detok = IncrementalDetokenizer(counting, [])
    text = "".join(detok.add(lead) for _ in range(500)) + detok.flush()
    assert text == "\ufffd" * 500
    assert counting.longest <= 64


@functools.cache
def clean_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids that decode to whole characters on their own (specials included), so any sequence of them does too."""
    return [i for i in range(len(tokenizer.hf)) if "\ufffd" not in tokenizer.decode([i], False)]


WORDS = st.sampled_from(["世界", "🎉", "👨\u200d👩\u200d👧", "é", " ", "  ", "\n", "テキスト", "a", " the", "🇫🇷", "ñ"])
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=6) | WORDS


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_random_clean_sequences_stream_exactly(tokenizer: Tokenizer, data: st.DataObject, skip: bool) -> None:
    clean = clean_ids(tokenizer)
    edgy = st.sampled_from([*tokenizer.hf.all_special_ids, *encode(tokenizer, " ")])  # specials, lone "▁"
    piece = (st.sampled_from(clean) | edgy).map(lambda i: [i]) | TEXT.map(lambda t: encode(tokenizer, t))
    ids = [i for p in data.draw(st.lists(piece, max_size=24)) for i in p]
    assume("\ufffd" not in tokenizer.decode(ids, skip))
    deltas = stream(tokenizer, ids, skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip)
    assert not any("\ufffd" in d for d in deltas)


# ---- StopChecker


def run_stops(stop: tuple[str, ...], chunks: list[str]) -> tuple[str, bool]:
    """Feeds the chunks, checking that what is held never exceeds max(len(stop)) - 1 chars."""
    checker = StopChecker(stop)
    fed = out = ""
    for chunk in chunks:
        fed += chunk
        text, hit = checker.feed(chunk)
        out += text
        if hit:
            return out, True
        assert len(fed) - len(out) <= max((len(s) for s in stop if s), default=1) - 1
    return out + checker.flush(), False


def expected_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """Searching the whole text: the stop string that ends first wins (as it would stream), the longest on a tie."""
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stop if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


@pytest.mark.parametrize(
    "chunks",
    [["Hello STOP world"], ["Hel", "lo ST", "O", "P more"], list("Hello STOP world"), ["Hello S", "TOP"]],
)
def test_stop_string_is_cut_wherever_it_splits(chunks: list[str]) -> None:
    assert run_stops(("STOP",), chunks) == ("Hello ", True)


def test_false_start_is_held_then_released() -> None:
    checker = StopChecker(("STOP",))
    assert checker.feed("go ST") == ("go ", False)
    assert checker.feed("A") == ("STA", False)
    assert checker.feed("ST") == ("", False)
    assert checker.flush() == "ST"


def test_earliest_stop_wins_and_overlaps_resolve() -> None:
    assert run_stops(("world", "lo w"), ["hello world"]) == ("hel", True)
    assert run_stops(("c", "aca"), ["aca"]) == ("a", True)  # "c" completes first, however the text is chunked
    assert run_stops(("ca", "bca"), ["abca"]) == ("a", True)  # both end together: the longer cuts earlier
    assert run_stops(("abcabd",), list("xabcabcabdyy")) == ("xabc", True)
    assert run_stops(("\n\n", "</answer>"), ["42</ans", "wer>\n\n"]) == ("42", True)


def test_nothing_after_a_stop_and_no_stops_pass_through() -> None:
    checker = StopChecker(("x",))
    assert checker.feed("abxcd") == ("ab", True)
    assert checker.feed("more") == ("", True)
    assert checker.flush() == ""
    passthrough = StopChecker(("",))
    assert passthrough.feed("any text") == ("any text", False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("abc", max_size=30),
    stop=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3).map(tuple),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_random_chunking_matches_a_search_of_the_whole_text(text: str, stop: tuple[str, ...], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run_stops(stop, chunks) == expected_stop(text, stop)


@SETTINGS
@given(data=st.data())
def test_stops_across_token_boundaries(tokenizer: Tokenizer, data: st.DataObject) -> None:
    """Tokens streamed through both: the stop (any substring, so often mid-token) is cut exactly."""
    text = data.draw(st.lists(TEXT, min_size=1, max_size=6).map("".join))
    ids = encode(tokenizer, text)
    decoded = tokenizer.decode(ids)
    assume(decoded and "\ufffd" not in decoded)  # characters SmolLM2's vocabulary lacks decode as U+FFFD
    start = data.draw(st.integers(0, len(decoded) - 1))
    stop = decoded[start : start + data.draw(st.integers(1, 6))]
    detok = IncrementalDetokenizer(tokenizer, [])
    checker = StopChecker((stop,))
    out, hit = "", False
    for delta in [*(detok.add(i) for i in ids), detok.flush()]:
        text_out, hit = checker.feed(delta)
        out += text_out
        if hit:
            break
    assert hit
    assert out == decoded[: decoded.find(stop)]
    assert stop not in out
