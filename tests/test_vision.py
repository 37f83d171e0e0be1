"""Vision-language models on the paged engine, against transformers, on tiny random checkpoints of
each family (Idefics3, Llava with a CLIP tower, Qwen3-VL-MoE with M-RoPE and DeepStack) saved with
their processors: logits, chunked prefill across an image, the prefix cache, the encoder cache,
and the engine's checks of what a request carries."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.loading.images import BadImage, open_image
from engine.model.vision.inputs import ImageInput, content_hash
from engine.process import wire
from engine.sampling_params import SamplingParams
from engine.scheduling.encoder_cache import EncoderCache
from engine.scheduling.images import RequestImages
from kvstore.spec import KVSpec
from tests.tiny_models import one_thread, rel_error
from tests.vision_models import (
    TinyVLM,
    build_tiny_vlm,
    image,
    reference_greedy,
    reference_inputs,
    reference_logits,
    run_chunks,
    vlm_runner,
)

FAMILIES = ("idefics3", "smolvlm", "llava", "llava_siglip", "qwen3_vl")
THRESHOLD = 1e-4
_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyVLM:
    return build_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param))


def prompts(t: TinyVLM) -> dict[str, tuple[str, list[Any]]]:
    """Text only, one image, two images, image-text-image (the second image another size)."""
    m = t.processor.marker
    return {
        "text": ("What is in this picture?", []),
        "one image": (f"{m}What is in this picture?", [image(1)]),
        "two images": (f"Compare {m} with {m} please", [image(1), image(2)]),
        "image-text-image": (f"{m} The quick brown fox {m}", [image(3), image(4, 64, 48)]),
    }


def test_logits_match_transformers(tiny: TinyVLM) -> None:
    runner, pool = vlm_runner(tiny)
    for name, (text, pictures) in prompts(tiny).items():
        ids, images = tiny.prompt(text, pictures)
        assert sum(i == tiny.config.vision.image_token_id for i in ids) == sum(im.num_tokens for im in images)  # type: ignore[union-attr]
        ref = reference_logits(tiny, ids, images)
        for chunk in (len(ids), 16, 5):
            err = rel_error(run_chunks(tiny, runner, pool, ids, images, chunk), ref)
            assert err < THRESHOLD, f"{tiny.family} {name}, chunks of {chunk}: error {err:.2e}"
    assert pool.num_free == pool.num_pages


def test_wrong_features_are_caught(tiny: TinyVLM) -> None:
    """The comparison can fail: another image's features in place of the right one's move the
    logits far past the threshold."""
    runner, pool = vlm_runner(tiny)
    ids, images = tiny.prompt(*prompts(tiny)["one image"])
    _, other = tiny.prompt(*prompts(tiny)["image-text-image"])
    swapped = [ImageInput(images[0].content_hash, other[0].tensors, images[0].num_tokens, images[0].grid)]
    if other[0].num_tokens != images[0].num_tokens:
        pytest.skip("the other image fills another number of placeholders")
    err = rel_error(run_chunks(tiny, runner, pool, ids, swapped, 16), reference_logits(tiny, ids, images))
    assert err > 100 * THRESHOLD


def test_mrope_positions_equal_transformers(tmp_path_factory: pytest.TempPathFactory, tiny: TinyVLM) -> None:
    """Qwen3-VL's positions after an image run behind the KV index; ours equal transformers'."""
    if tiny.family != "qwen3_vl":
        pytest.skip("1-D positions")
    ids, images = tiny.prompt(*prompts(tiny)["image-text-image"])
    placed = RequestImages.build(ids, images, tiny.config.vision.image_token_id, True)  # type: ignore[union-attr]
    kwargs = reference_inputs(tiny, ids, images)
    ref, delta = tiny.ref.model.get_rope_index(
        kwargs["input_ids"], kwargs["mm_token_type_ids"], image_grid_thw=kwargs["image_grid_thw"]
    )
    assert placed.rope == ref[:, 0].tolist()
    assert placed.rope_delta == int(delta) < 0
    assert placed.rope_at(len(ids), len(ids) + 2) == [[len(ids) + placed.rope_delta + i for i in range(2)]] * 3


def _engine(t: TinyVLM, budget: int = 16, prefix: bool = True, encoder_cache: int = 1 << 20) -> Engine:
    mc = t.config
    spec = KVSpec(mc.num_layers, t.model.local_kv_heads, mc.head_dim, 16, "float32")
    config = EngineConfig(
        kv_cache_bytes=64 * spec.bytes_per_page, attention_backend="torch_paged", max_num_batched_tokens=budget,
        enable_prefix_caching=prefix, encoder_cache_bytes=encoder_cache,
    )  # fmt: skip
    return Engine(t.model, None, config)


def _greedy(engine: Engine, ids: list[int], images: list[ImageInput], n: int = 6) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    handle = engine.add_request(ids, params, images=images)
    engine.run_until_idle()
    outs = list(handle)
    assert outs[-1].error is None, outs[-1].error
    return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens


def test_chunked_prefill_splits_images_and_matches_greedy(tiny: TinyVLM) -> None:
    """A budget of 16 tokens per step: every image's placeholders span steps; greedy tokens equal
    transformers' `generate`, and each image is encoded once."""
    engine = _engine(tiny, budget=16, prefix=False)
    feeder = engine.images
    assert feeder is not None
    for name, (text, pictures) in prompts(tiny).items():
        ids, images = tiny.prompt(text, pictures)
        before = feeder.num_encoded
        ours, _ = _greedy(engine, ids, images)
        assert ours == reference_greedy(tiny, ids, images, 6), f"{tiny.family} {name}"
        assert feeder.num_encoded - before == len({im.content_hash for im in images}) or name == "two images"
    assert engine.pool.num_free == engine.pool.num_pages
    assert not any(feeder.cache.held(k) for k in list(feeder.cache._entries))


def test_prefix_cache_hits_the_same_image_and_misses_another(tiny: TinyVLM) -> None:
    """The same prompt and image again: its pages (image included) come from the prefix cache and
    the image from the encoder cache. Another image of the same size in the same place: only the
    pages before it are shared, and the tokens are that image's own."""
    engine = _engine(tiny, budget=64)
    feeder = engine.images
    assert feeder is not None
    m = tiny.processor.marker
    text = f"The quick brown fox jumps over the lazy dog. {m} What is in this picture?"
    ids_a, images_a = tiny.prompt(text, [image(5)])
    ids_b, images_b = tiny.prompt(text, [image(6)])
    assert ids_a == ids_b and images_a[0].content_hash != images_b[0].content_hash
    first_image = ids_a.index(tiny.config.vision.image_token_id)  # type: ignore[union-attr]
    tokens_a, cached = _greedy(engine, ids_a, images_a)
    assert cached == 0 and feeder.num_encoded == 1
    again, cached = _greedy(engine, ids_a, images_a)
    assert again == tokens_a == reference_greedy(tiny, ids_a, images_a, 6)
    assert cached == (len(ids_a) - 1) // 16 * 16 > first_image
    assert feeder.num_encoded == 1  # the features came from the encoder cache
    other, cached = _greedy(engine, ids_b, images_b)
    assert cached == first_image // 16 * 16  # pages before the image only
    assert other == reference_greedy(tiny, ids_b, images_b, 6)
    # Both images' pages are now in the pool, each under its own image's hash.
    assert _greedy(engine, ids_a, images_a) == (tokens_a, (len(ids_a) - 1) // 16 * 16)
    assert _greedy(engine, ids_b, images_b) == (other, (len(ids_b) - 1) // 16 * 16)
    assert feeder.num_encoded == 2


def test_engine_refuses_images_that_do_not_fit(tiny: TinyVLM) -> None:
    engine = _engine(tiny)
    ids, images = tiny.prompt(*prompts(tiny)["two images"])
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="images: the prompt has"):
        engine.add_request(ids, params, images=images[:1])
    with pytest.raises(ValueError, match="images: the prompt has"):
        engine.add_request(ids, params)  # placeholders without images
    text_ids, _ = tiny.prompt("What is in this picture?", [])
    with pytest.raises(ValueError, match="images: the prompt has"):
        engine.add_request(text_ids, params, images=images)


def test_a_failing_image_ends_its_request_alone(tiny: TinyVLM) -> None:
    engine = _engine(tiny, budget=256)
    ids, images = tiny.prompt(*prompts(tiny)["one image"])
    broken = [
        ImageInput(
            b"x" * 16, {k: v[..., :1] for k, v in images[0].tensors.items()}, images[0].num_tokens, images[0].grid
        )
    ]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    bad = engine.add_request(ids, params, images=broken)
    good = engine.add_request(ids, params, images=images)
    engine.run_until_idle()
    bad_outs, good_outs = list(bad), list(good)
    assert bad_outs[-1].error and "images" in bad_outs[-1].error
    assert good_outs[-1].error is None and len([t for o in good_outs for t in o.token_ids]) == 3
    assert engine.pool.num_free == engine.pool.num_pages


def test_text_model_refuses_images(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_models import build_tiny

    t = build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path)
    engine = Engine(t.model, None, EngineConfig(kv_cache_bytes=1 << 20, attention_backend="torch_paged"))
    item = ImageInput(b"h" * 16, {"pixel_values": torch.zeros(1, 3, 4, 4)}, 2)
    with pytest.raises(ValueError, match=r"images: the model \(LlamaForCausalLM\) takes no image input"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), images=[item])


def test_encoder_cache_keeps_held_entries_and_evicts_the_rest_by_age() -> None:
    class Blob:
        def __init__(self, n: int):
            self.nbytes = n

    cache: EncoderCache[Any] = EncoderCache(100)
    a, b = object(), object()
    cache.hold(b"1", a)
    cache.put(b"1", Blob(80))
    cache.put(b"2", Blob(30))  # over budget: 2 is the only unheld entry
    assert b"1" in cache and b"2" not in cache and cache.stats.evictions == 1
    cache.put(b"3", Blob(10))
    cache.release(b"1", a)  # unheld and over budget with 3: the older goes
    assert b"1" in cache and b"3" in cache and cache.num_bytes == 90
    cache.hold(b"4", b)
    cache.put(b"4", Blob(200))  # held: kept past the budget, the unheld are evicted
    assert b"4" in cache and len(cache) == 1 and cache.num_bytes == 200
    assert cache.get(b"4") is not None and cache.get(b"1") is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    with pytest.raises(ValueError):
        EncoderCache(-1)


def test_page_hashes_mix_in_the_image() -> None:
    one = ImageInput(b"a" * 16, {}, 5)
    two = ImageInput(b"b" * 16, {}, 5)
    ids = [1] * 10 + [9] * 5 + [2] * 20
    a = RequestImages.build(ids, [one], 9, False)
    b = RequestImages.build(ids, [two], 9, False)
    assert a.page_extra(0, 8) == b.page_extra(0, 8) == b""  # before the image: a text page
    assert a.page_extra(1, 8) != b.page_extra(1, 8)  # holds placeholders 0..4 of different images
    assert a.page_extra(2, 8) == b""  # after it: the chain carries the image
    with pytest.raises(ValueError, match="images"):
        RequestImages.build(ids, [one, two], 9, False)


def test_images_cross_the_wire_unchanged() -> None:
    tensors = {"pixel_values": torch.randn(1, 2, 3, 4), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    item = ImageInput(content_hash(tensors), tensors, 1, (1, 1, 1))
    msg = wire.Add("r", [1, 2], SamplingParams(), images=wire.encode_images([item]))
    back = wire.to_engine.decode(wire.encoder.encode(msg))
    assert isinstance(back, wire.Add)
    (got,) = wire.decode_images(back.images)
    assert got.content_hash == item.content_hash and got.num_tokens == 1 and got.grid == (1, 1, 1)
    assert all(torch.equal(got.tensors[k], v) for k, v in tensors.items())
    assert content_hash(got.tensors) == item.content_hash


def test_image_files() -> None:
    pic = image(7)
    data = {}
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        buf = io.BytesIO()
        pic.save(buf, format=fmt)
        data[fmt] = buf.getvalue()
    for fmt, raw in data.items():
        got = open_image(raw)
        assert got.mode == "RGB" and got.size == pic.size, fmt
    assert open_image(data["PNG"]).tobytes() == pic.tobytes()
    with pytest.raises(BadImage):
        open_image(b"not an image")


def test_preempted_request_recomputes_its_images_without_re_encoding(tiny: TinyVLM) -> None:
    """A pool too small for two image requests to decode side by side: the newer one is preempted
    and recomputed from its tokens; its image comes back from the encoder cache, and both answers
    equal transformers'."""
    if tiny.family not in ("idefics3", "qwen3_vl"):
        pytest.skip("one family with 1-D positions, one with M-RoPE")
    ids_a, images_a = tiny.prompt(*prompts(tiny)["one image"])
    ids_b, images_b = tiny.prompt(prompts(tiny)["one image"][0], [image(9)])
    n = 24
    pages = -(-(len(ids_a) + n) // 16) + -(-(len(ids_b) + n) // 16) - 2
    mc = tiny.config
    spec = KVSpec(mc.num_layers, tiny.model.local_kv_heads, mc.head_dim, 16, "float32")
    config = EngineConfig(
        kv_cache_bytes=pages * spec.bytes_per_page, attention_backend="torch_paged", max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )  # fmt: skip
    engine = Engine(tiny.model, None, config)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    handles = [engine.add_request(ids_a, params, images=images_a), engine.add_request(ids_b, params, images=images_b)]
    engine.run_until_idle()
    got = [[t for o in h for t in o.token_ids] for h in handles]
    assert engine.scheduler.num_preemptions > 0
    assert engine.images is not None and engine.images.num_encoded == 2
    assert got[0] == reference_greedy(tiny, ids_a, images_a, n)
    assert got[1] == reference_greedy(tiny, ids_b, images_b, n)
