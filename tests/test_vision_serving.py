"""Images on the paths that serve: the compiled step on chunks carrying image features, and
`longctx generate --image` through the engine process, against transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model.compile_setup import compile_available, prepare
from engine.model.compiled import CompiledStep
from tests.compile_cache import configure_compile
from tests.server import ROOT
from tests.tiny_models import rel_error
from tests.vision_models import (
    TinyVLM,
    build_tiny_vlm,
    image,
    reference_greedy,
    reference_logits,
    run_chunks,
    vlm_runner,
)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory: pytest.TempPathFactory) -> TinyVLM:
    return build_tiny_vlm("idefics3", tmp_path_factory.mktemp("idefics3"))


@pytest.fixture
def compiled_setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """The compiled step's caches as `tests/test_compile.py` has them (the same tiny decoder
    shapes: its graphs are found in inductor's cache there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    configure_compile(tmp_path / "graphs")
    prepare()
    yield
    torch.set_num_threads(threads)


@pytest.mark.skipif(compile_available() is not None, reason=f"cannot compile: {compile_available()}")
def test_compiled_step_merges_images(idefics3: TinyVLM, compiled_setup: None) -> None:
    """Chunks of 16 with image features in them run the compiled regions (bucket 16, and 4 for
    the last) and give the eager step's logits (the image chunks' rows included), and
    transformers'."""
    t = idefics3
    ids, images = t.prompt(f"{t.processor.marker} What is in this picture?", [image(1)])
    assert len(ids) % 16 and len(ids) > 32
    runner, pool = vlm_runner(t)
    eager = run_chunks(t, runner, pool, ids, images, 16)
    runner, pool = vlm_runner(t)
    step = runner.step = CompiledStep(t.model)
    compiled = run_chunks(t, runner, pool, ids, images, 16)
    assert {16, 4} <= step.compiled_buckets or {16, 8} <= step.compiled_buckets
    token = t.config.vision.image_token_id  # type: ignore[union-attr]
    rows = [i for i, x in enumerate(ids) if x == token]
    assert rows and rel_error(compiled[rows], eager[rows]) <= 1e-5
    assert rel_error(compiled, eager) <= 1e-5
    err = rel_error(compiled, reference_logits(t, ids, images))
    assert err < 1e-4, f"error {err:.2e}"


@pytest.mark.slow
def test_cli_generate_with_images(idefics3: TinyVLM, tmp_path: Path) -> None:
    """`longctx generate --image A --image B --prompt ...` prints transformers' greedy text."""
    t = idefics3
    files = [tmp_path / "a.png", tmp_path / "b.jpg"]
    image(1).save(files[0])
    image(2, 64, 48).save(files[1], quality=95)
    prompt = f"Compare {t.processor.marker} with {t.processor.marker} please"
    ids, images = t.prompt(prompt, [f.read_bytes() for f in files])
    tok = t.processor.tokenizer
    t.ref.generation_config.eos_token_id = None
    expected = tok.decode(reference_greedy(t, ids, images, 8), skip_special_tokens=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {"HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "api.cli", "generate", "--model", str(t.path), "--prompt", prompt, "--max-tokens", "8"]
    cmd += ["--dtype", "float32", "--no-compile", "--threads", "1", "--kv-cache-bytes", "8MB"]
    cmd += ["--image", str(files[0]), "--image", str(files[1])]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == expected + "\n"
    assert f"{len(ids)} prompt tokens" in out.stderr


def test_cli_image_errors(idefics3: TinyVLM, tmp_path: Path) -> None:
    """What `--image` refuses, in the words the CLI prints (`longctx: error: ...`)."""
    import argparse

    from api.generate import image_prompt
    from engine.loading.images import BadImage
    from engine.loading.model_source import ModelPath

    t = idefics3
    loaded = argparse.Namespace(config=t.config, source=ModelPath("safetensors", t.path, "tiny"), tokenizer=None)
    args = argparse.Namespace(prompt="hi", chat=False, tools=None, json_schema=None, image=[tmp_path / "missing.png"])
    with pytest.raises(ValueError, match=r"--image .*missing\.png: cannot read the file"):
        image_prompt(args, loaded)
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    args.image = [tmp_path / "bad.png"]
    with pytest.raises(BadImage, match="not a readable image"):
        image_prompt(args, loaded)
    args.image, args.prompt = [tmp_path / "bad.png"] * 2, f"one {t.processor.marker} marker"
    with pytest.raises(ValueError, match="1 image markers"):
        image_prompt(args, loaded)
    text = argparse.Namespace(
        config=argparse.Namespace(vision=None, architecture="LlamaForCausalLM"), source=loaded.source
    )
    with pytest.raises(ValueError, match="takes no image input"):
        image_prompt(args, text)
