"""Images on the engine: encode time, image tokens, and time to first token with one image.

    python bench/vision.py [--model DIR] [--families idefics3,llava,qwen3_vl] [--dtype float32]
        [--threads 2] [--repeats 3]

Without `--model`, on tiny random checkpoints of each family built in a temporary directory
(`tests/vision_models.py`; no vision-language weights can be fetched here); with `--model`, on a
local vision-language checkpoint (config.json, safetensors and its processor). Per model, on two
fixed images (`api/doctor/vision_stage.test_images`), through the in-process `Engine`:

- encode: seconds of one image through the vision tower and connector (median of repeats);
- image tokens: placeholder tokens (= features) per image;
- TTFT cold: a prompt with an image nobody has sent (encoder and prefix caches miss);
- TTFT image cached: the same image after different text (the encoder cache hits, the prefix
  cache does not reach the image);
- TTFT prefix cached: the same prompt again (the image's pages come from the prefix cache);
- agree: whether the prefix-cached run's greedy first token is the cold run's, every repeat.

Prints a table and writes bench/results/vision.json, with the load average beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.doctor.vision_stage import test_images
from engine.engine import Engine, EngineConfig
from engine.loading.images import ImageProcessor
from engine.loading.loader import load
from engine.sampling_params import SamplingParams


def _ttft(engine: Engine, ids: list[int], images: list[Any]) -> tuple[float, list[int]]:
    """Seconds to the first token, and the token (greedy)."""
    t0 = time.perf_counter()
    handle = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), images=images)
    engine.run_until_idle()
    outs = list(handle)
    assert outs[-1].error is None, outs[-1].error
    return time.perf_counter() - t0, [t for o in outs for t in o.token_ids]


def measure(path: Path, dtype: str, repeats: int) -> dict[str, Any]:
    loaded = load(str(path), dtype, progress=False)
    vision = loaded.config.vision
    assert vision is not None and loaded.model.vision is not None, f"{path} is not a vision-language checkpoint"
    processor = ImageProcessor.load(path, vision)
    pictures = test_images()
    m = processor.marker
    _, inputs = processor.prompt(m * len(pictures), pictures)
    encode = []
    with torch.inference_mode():
        loaded.model.vision(inputs[0].tensors)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            loaded.model.vision(inputs[0].tensors)
            encode.append(time.perf_counter() - t0)
    cold, image_cached, prefix_cached = [], [], []
    agree = True
    for r in range(repeats):
        engine = Engine(
            loaded.model, loaded.tokenizer, EngineConfig(kv_cache_bytes=256 << 20, attention_backend="auto")
        )
        ids, images = processor.prompt(f"Question {r}: {m} What is in this picture?", pictures[:1])
        (s_cold, first), (s_prefix, again) = _ttft(engine, ids, images), _ttft(engine, ids, images)
        cold.append(s_cold)
        prefix_cached.append(s_prefix)
        agree = agree and first == again
        ids2, images2 = processor.prompt(f"Another question, number {r + 10}: {m} Describe it.", pictures[:1])
        image_cached.append(_ttft(engine, ids2, images2)[0])
    return {
        "model": loaded.source.name,
        "architecture": vision.architecture,
        "dtype": dtype,
        "image_tokens": [im.num_tokens for im in inputs],
        "encode_s": statistics.median(encode),
        "ttft_cold_s": statistics.median(cold),
        "ttft_image_cached_s": statistics.median(image_cached),
        "ttft_prefix_cached_s": statistics.median(prefix_cached),
        "prompt_tokens": len(ids),
        "agree": agree,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a local vision-language checkpoint directory")
    ap.add_argument("--families", default="idefics3,llava,qwen3_vl", help="tiny checkpoints to build (no --model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            paths = [args.model]
        else:
            from tests.vision_models import build_checkpoint

            paths = []
            for family in args.families.split(","):
                build_checkpoint(family, Path(tmp) / family)
                paths.append(Path(tmp) / family)
        for path in paths:
            rows.append(measure(path, args.dtype, args.repeats))
    print(f"{'model':<34} {'image tokens':>13} {'encode ms':>10} {'TTFT cold':>10} {'image cached':>13} ", end="")
    print(f"{'prefix cached':>14} {'agree':>6}")
    for r in rows:
        print(
            f"{r['architecture']:<34} {r['image_tokens']!s:>13} {r['encode_s'] * 1e3:>10.1f} "
            f"{r['ttft_cold_s'] * 1e3:>8.1f}ms {r['ttft_image_cached_s'] * 1e3:>11.1f}ms "
            f"{r['ttft_prefix_cached_s'] * 1e3:>12.1f}ms {'yes' if r['agree'] else 'NO':>6}"
        )
    load_avg = os.getloadavg()
    print(f"load average {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}; {args.threads} threads; {args.dtype}")
    out = Path(__file__).resolve().parent / "results" / "vision.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"loadavg": load_avg, "threads": args.threads, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
