"""The vision stage: a vision-language checkpoint's image path against transformers, stage by
stage, then image prompts end to end.

On fixed synthetic images (two sizes), in order: the vision tower's output, the connector's
(Idefics3's pixel shuffle + projection, Llava's projector, Qwen3-VL's merger and DeepStack
mergers), the merged input embeddings of a prompt (image features in their placeholders' rows),
and that prompt's logits. Each is compared with transformers' model of the same checkpoint; the
first stage past the threshold is named (a tower that differs names the tower, not the logits).
Our tower and connector are transformers' modules filled by our loader, so a difference there is
a loading fault (a mapping, a dtype); past them, it is ours (placeholder order, M-RoPE positions,
DeepStack rows). Then greedy answers to image-then-text, text-then-image and two-image prompts
through the engine, compared with transformers' `generate`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from api.doctor.context import DoctorContext
from api.doctor.report import StageResult
from api.doctor.tolerance import threshold
from engine.verify.agreement import rel_error

GREEDY_TOKENS = 8


def test_images() -> list[Any]:
    """Two fixed images: a 64x48 gradient with a square, a 40x56 checkerboard."""
    from PIL import Image, ImageDraw

    a = Image.new("RGB", (64, 48))
    for x in range(64):
        for y in range(48):
            a.putpixel((x, y), (4 * x, 5 * y, 128))
    ImageDraw.Draw(a).rectangle((16, 12, 40, 36), fill=(220, 30, 30))
    b = Image.new("RGB", (40, 56), (240, 240, 240))
    draw = ImageDraw.Draw(b)
    for i in range(0, 40, 8):
        for j in range(0, 56, 8):
            if (i + j) // 8 % 2:
                draw.rectangle((i, j, i + 7, j + 7), fill=(20, 20, 160))
    return [a, b]


def load_reference(ctx: DoctorContext) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(ctx.loaded.source.path), dtype=ctx.dtype).eval()


def reference_encoder(ours: Any, ref: Any, family: str) -> Any:
    """Our encoder's glue around the reference model's tower and connector modules."""
    enc = copy.copy(ours)
    enc._modules = dict(ours._modules)
    if family == "idefics3":
        enc.tower, enc.connector = ref.model.vision_model, ref.model.connector
    elif family == "llava":
        enc.tower, enc.projector = ref.model.vision_tower, ref.model.multi_modal_projector
    else:
        enc.tower = ref.model.visual
    return enc


def reference_kwargs(family: str, ids: list[int], images: list[Any], image_token: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    if family == "idefics3":
        kwargs["pixel_values"] = torch.cat([im.tensors["pixel_values"] for im in images], dim=1)
        kwargs["pixel_attention_mask"] = torch.cat([im.tensors["pixel_attention_mask"] for im in images], dim=1)
    elif family == "llava":
        kwargs["pixel_values"] = torch.cat([im.tensors["pixel_values"] for im in images])
    else:
        kwargs["pixel_values"] = torch.cat([im.tensors["pixel_values"] for im in images])
        kwargs["image_grid_thw"] = torch.cat([im.tensors["image_grid_thw"] for im in images])
        kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == image_token).int()
    return kwargs


def _merged_ours(ctx: DoctorContext, ids: list[int], images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our merged input embeddings [T, hidden] (layer 0's input) and logits [T, V]."""
    from api.doctor.capture import runner_for
    from engine.model_runner import Chunk
    from engine.scheduling.encoder_cache import EncoderCache
    from engine.scheduling.images import ImageFeeder, RequestImages

    model = ctx.loaded.model
    vision = ctx.loaded.config.vision
    assert vision is not None and model.vision is not None
    runner, pool = runner_for(model, len(ids))
    placed = RequestImages.build(ids, images, vision.image_token_id, bool(ctx.loaded.config.rope.mrope_section))
    feeder = ImageFeeder(model.vision, EncoderCache(0), model.model.norm.weight.device)
    seen: list[torch.Tensor] = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().float()))
    try:
        pages = pool.allocate(-(-len(ids) // 16))
        chunk = Chunk(ids, pages, len(ids), 0, feeder.chunk(model, placed, 0, len(ids)))
        logits = runner.run([chunk], all_logits=True).float()
    finally:
        hook.remove()
    return seen[0], logits


def _merged_reference(ref: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    seen: list[torch.Tensor] = []
    text_model = ref.model.get_decoder() if hasattr(ref.model, "get_decoder") else ref.model.language_model
    layer0 = text_model.layers[0]
    hook = layer0.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0].detach().float()))
    try:
        with torch.no_grad():
            logits = ref(**kwargs, use_cache=False).logits[0].float()
    finally:
        hook.remove()
    return seen[0], logits


def vision_stage(ctx: DoctorContext, st: StageResult) -> None:
    from engine.loading.images import ImageProcessor

    config = ctx.loaded.config
    vision = config.vision
    if vision is None:
        st.skip("a text-only model")
        return
    model = ctx.loaded.model
    assert model.vision is not None
    ref = ctx.reference_model
    if ref is None:
        try:
            ref = load_reference(ctx)
        except Exception as e:  # transformers may not implement this checkpoint
            st.skip(f"transformers cannot load this checkpoint: {type(e).__name__}: {str(e)[:200]}")
            return
    processor = ImageProcessor.load(ctx.loaded.source.path, vision)
    limit = threshold(ctx.dtype)
    pictures = test_images()
    m = processor.marker
    ids, images = processor.prompt(f"{m} Describe this picture. {m}", pictures)
    rows: list[list[object]] = []
    first: str | None = None

    def check(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        nonlocal first
        err = rel_error(ours.float(), theirs.float())
        rows.append([name, list(ours.shape), err])
        if first is None and not err <= limit:
            first = f"{name}: relative error {err:.2e} > {limit:.0e}"

    theirs_enc = reference_encoder(model.vision, ref, vision.family)
    with torch.inference_mode():
        for k, im in enumerate(images):
            ours_stages = model.vision.stages(im.tensors)
            ref_stages = theirs_enc.stages(im.tensors)
            for name in ours_stages:
                check(f"image {k} {name}", ours_stages[name], ref_stages[name])
    with torch.inference_mode():
        merged, logits = _merged_ours(ctx, ids, images)
    ref_merged, ref_logits = _merged_reference(ref, reference_kwargs(vision.family, ids, images, vision.image_token_id))
    check("merged input embeddings", merged, ref_merged)
    check("logits", logits, ref_logits)
    st.table(["stage", "shape", "relative error"], rows)
    st.data.update(stages=rows, threshold=limit, image_tokens=[im.num_tokens for im in images])
    st.note(f"{len(images)} images, {[im.num_tokens for im in images]} image tokens, {len(ids)} prompt tokens")
    if first is not None:
        st.fail(f"first diverging stage: {first}")
        return
    _generation(ctx, st, processor, ref, pictures)


def _generation(ctx: DoctorContext, st: StageResult, processor: Any, ref: Any, pictures: list[Any]) -> None:
    """Greedy answers through the engine against transformers' `generate`."""
    from engine.engine import Engine, EngineConfig
    from engine.sampling_params import SamplingParams

    vision = ctx.loaded.config.vision
    assert vision is not None
    m = processor.marker
    cases = {
        "image then text": (f"{m} What is in this picture?", pictures[:1]),
        "text then image": (f"Look at this: {m}", pictures[1:]),
        "two images": (f"{m} and {m}: which is brighter?", pictures),
    }
    engine = Engine(ctx.loaded.model, None, EngineConfig(kv_cache_bytes=64 << 20, attention_backend="auto"))
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    for name, (text, images_in) in cases.items():
        ids, images = processor.prompt(text, images_in)
        handle = engine.add_request(ids, params, images=images)
        engine.run_until_idle()
        outs = list(handle)
        if outs[-1].error:
            st.fail(f"{name}: {outs[-1].error}")
            continue
        ours = [t for o in outs for t in o.token_ids]
        kwargs = reference_kwargs(vision.family, ids, images, vision.image_token_id)
        with torch.no_grad():
            out = ref.generate(**kwargs, do_sample=False, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS)
        theirs = [int(t) for t in out[0, len(ids) :]]
        st.data.setdefault("greedy", {})[name] = {"ours": ours, "transformers": theirs}
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if same is None:
            st.note(f"{name}: {GREEDY_TOKENS} greedy tokens equal to transformers'")
        else:
            st.warn(f"{name}: greedy tokens diverge from transformers' at step {same} (a near-tie or an error)")
