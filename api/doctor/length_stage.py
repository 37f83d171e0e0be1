"""Stage 6, length: how cost grows with the prompt, and whether long prompts still work.

At 1k, 2k, 4k, ... tokens up to `--max-length` (the model's context by default; one length
when that is under 1k): prefill in engine-sized chunks through our runner, then greedy decode
steps, timed; KV bytes; process peak RSS; logits finite (a NaN or Inf fails). On an instruct
model (one with a chat template) each length holds a passkey retrieval at three depths: a
random 5-digit key hidden in filler text, asked for at the end. Accuracy is reported, never a
failure (a small model may simply not manage it).
"""

from __future__ import annotations

import random
import resource
import sys
import time

import torch

from api.doctor.capture import PAGE_SIZE, runner_for
from api.doctor.context import DoctorContext
from api.doctor.report import StageResult
from engine.model_runner import Chunk, ModelRunner
from kvstore.block_pool import BlockPool

CHUNK = 512  # prefill tokens per step, the engine's default budget
DECODE_STEPS = 16  # room for "The pass key is 12345." after the prompt
DEPTHS = (0.1, 0.5, 0.9)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def lengths(max_length: int) -> list[int]:
    out, n = [], 1024
    while n < max_length:
        out.append(n)
        n *= 2
    return [*out, max_length]


def passkey_prompt(ctx: DoctorContext, length: int, depth: float, key: str) -> list[int]:
    """A chat prompt of about `length` tokens with the key `depth` of the way into the filler."""
    tok = ctx.loaded.tokenizer
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? The pass key is"

    def render(filler_units: int) -> list[int]:
        before = int(filler_units * depth)
        text = FILLER * before + needle + FILLER * (filler_units - before)
        body = "There is a pass key hidden in this text. Find it.\n" + text + "\n" + question
        if tok.chat_template:
            return tok.apply_chat_template([{"role": "user", "content": body}])
        return tok.encode(body)

    unit = max(1, len(tok.encode(FILLER)))
    n = max(1, (length - len(render(0))) // unit)
    ids = render(n)
    while len(ids) > length and n > 0:  # tokenization is not additive; trim to fit
        n -= 1
        ids = render(n)
    return ids


def _run(runner: ModelRunner, pool: BlockPool, ids: list[int], steps: int) -> tuple[float, float, list[int], bool]:
    """Prefill then greedy decode. Returns (prefill seconds, decode seconds, tokens, all logits finite)."""
    pages = pool.allocate(-(-(len(ids) + steps) // PAGE_SIZE))
    try:
        finite = True
        t0 = time.perf_counter()
        for start in range(0, len(ids), CHUNK):
            part = ids[start : start + CHUNK]
            logits = runner.run([Chunk(part, pages, start + len(part))])
        finite &= bool(torch.isfinite(logits).all())
        prefill = time.perf_counter() - t0
        out = [int(logits[-1].argmax())]
        t1 = time.perf_counter()
        for i in range(steps - 1):
            logits = runner.run([Chunk(out[-1:], pages, len(ids) + i + 1)])
            finite &= bool(torch.isfinite(logits).all())
            out.append(int(logits[-1].argmax()))
        return prefill, time.perf_counter() - t1, out, finite
    finally:
        pool.free(pages)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def length_stage(ctx: DoctorContext, st: StageResult) -> None:
    config = ctx.loaded.config
    max_length = min(ctx.options.max_length or config.max_position_embeddings, config.max_position_embeddings)
    model = ctx.loaded.model
    runner, pool = runner_for(model, max_length + DECODE_STEPS)
    per_token = runner.kv_cache.spec.bytes_per_token
    instruct = bool(ctx.loaded.tokenizer.chat_template)
    rng = random.Random(1234)
    rows: list[list[object]] = []
    found_total = 0
    tried_total = 0
    for n in lengths(max_length):
        prefills, decodes, found = [], [], 0
        depths = DEPTHS if instruct else (0.5,)
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            ids = passkey_prompt(ctx, n - DECODE_STEPS, depth, key)
            prefill, decode, out, finite = _run(runner, pool, ids, DECODE_STEPS)
            prefills.append(len(ids) / prefill)
            decodes.append((DECODE_STEPS - 1) / decode if decode > 0 else 0.0)
            if not finite:
                st.fail(f"{len(ids)}-token prompt: NaN or Inf in the logits")
            found += key in ctx.loaded.tokenizer.decode(out)
            print(f"  length {n}: depth {depth:.0%}, prefill {prefill:.1f} s", file=sys.stderr, flush=True)
        kv_bytes = n * per_token
        passkey = f"{found}/{len(depths)}" if instruct else "-"
        found_total += found if instruct else 0
        tried_total += len(depths) if instruct else 0
        rows.append(
            [
                n,
                sorted(prefills)[len(prefills) // 2],
                sorted(decodes)[len(decodes) // 2],
                f"{kv_bytes / 1e6:.1f} MB",
                f"{peak_rss_bytes() / 1e9:.2f} GB",
                passkey,
            ]
        )
    st.table(["tokens", "prefill tok/s", "decode tok/s", "KV bytes", "peak RSS", "passkey"], rows)
    st.data = {"rows": rows, "kv_bytes_per_token": per_token, "max_length": max_length}
    if instruct:
        st.note(f"passkey retrieval {found_total}/{tried_total} (reported only)")
    else:
        st.note("no chat template: passkey retrieval not attempted")
