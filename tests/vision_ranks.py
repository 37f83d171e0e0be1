"""What each rank runs in tests/test_vision_parallel.py (`python -m tests.vision_ranks MODEL OUT --modes tp,ep`).

RANK/WORLD_SIZE/MASTER_* are set by the caller (as torchrun does). Per mode, every rank loads
its shard of the vision-language checkpoint (the image encoder whole on each), runs the same
chunks of an image prompt through its sharded runner, then rank 0 runs greedy requests with
images through the engine while rank 1 replays its plans (the image features travel in them).
Each rank saves its results to OUT/rank{r}-{mode}.pt.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from engine.distributed.launch import init_parallel, leave_together
from engine.distributed.parallel import ParallelContext
from engine.distributed_runner import DistributedRunner, serve_worker
from engine.engine import Engine
from engine.loading.images import ImageProcessor
from engine.loading.weights import SafetensorsSource, load_model
from engine.model.config import ModelConfig
from engine.model.vision.inputs import ImageInput
from engine.sampling_params import SamplingParams
from kvstore.block_pool import BlockPool
from tests import parallel_ranks

GREEDY_TOKENS = 8


def inputs(model_dir: Path) -> list[tuple[list[int], list[ImageInput]]]:
    """Three requests: two images, one image, text only."""
    import numpy as np
    from PIL import Image

    def picture(seed: int) -> Image.Image:
        return Image.fromarray((np.random.RandomState(seed).rand(40, 56, 3) * 255).astype(np.uint8))

    config = ModelConfig.from_pretrained_dir(model_dir)
    assert config.vision is not None
    processor = ImageProcessor.load(model_dir, config.vision)
    m = processor.marker
    return [
        processor.prompt(f"A {m} and {m} then", [picture(1), picture(2)]),
        processor.prompt(f"{m} What is in this picture?", [picture(3)]),
        processor.prompt("The quick brown fox", []),
    ]


def run_mode(ctx: ParallelContext, model_dir: Path) -> dict[str, object]:
    from engine.scheduling.encoder_cache import EncoderCache
    from engine.scheduling.images import ImageFeeder, RequestImages

    config = ModelConfig.from_pretrained_dir(model_dir)
    model, _ = load_model(config, SafetensorsSource(model_dir), torch.float32, progress=False, parallel=ctx)
    assert model.vision is not None and config.vision is not None
    runner = parallel_ranks.sharded_runner(model)
    pool = BlockPool(runner.kv_cache.num_pages)
    requests = inputs(model_dir)
    ids, images = requests[0]
    feeder = ImageFeeder(model.vision, EncoderCache(1 << 20), torch.device("cpu"))
    placed = RequestImages.build(ids, images, config.vision.image_token_id, True)
    pages = pool.allocate(-(-len(ids) // parallel_ranks.PAGE_SIZE))
    ctx.comm.reset()
    logits = []
    from engine.model_runner import Chunk

    for start in range(0, len(ids), 7):  # chunks of 7 split the images
        end = min(start + 7, len(ids))
        chunk = Chunk(ids[start:end], pages, end, 0, feeder.chunk(ctx, placed, start, end))
        logits.append(runner.run([chunk], all_logits=True))
    result: dict[str, object] = {"logits": torch.cat(logits), "comm": ctx.comm.total}
    if ctx.is_driver:
        dist = DistributedRunner(parallel_ranks.local_runner(model), ctx)
        engine = Engine(model, None, parallel_ranks.engine_config(), parallel=ctx, runner=dist)
        params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
        handles = [engine.add_request(i, params, images=im) for i, im in requests]
        engine.run_until_idle()
        result["greedy"] = [[t for out in h for t in out.token_ids] for h in handles]
        dist.shutdown()
    else:
        result["steps"] = serve_worker(model, ctx)
    return result


def main(argv: list[str]) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    model_dir, out, modes = Path(argv[0]), Path(argv[1]), argv[3].split(",")
    base, watchdog = init_parallel(2)
    for mode in modes:
        ctx = ParallelContext(base.rank, base.world_size, mode == "ep", base.group)
        torch.save(run_mode(ctx, model_dir), out / f"rank{ctx.rank}-{mode}.pt")
    leave_together(watchdog)


if __name__ == "__main__":
    main(sys.argv[1:])
