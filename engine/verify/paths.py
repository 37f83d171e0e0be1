"""Every path a start can choose, run over one fixed schedule and compared with eager float32.

A path is what `--dtype`, `--compile` and `--quantization` select, and then what the dispatcher
picks on the CPU at hand for each product and each attention call. `forced(path)` makes this CPU
take a path it would not pick by itself, where it can run it (an AVX-512 CPU runs the emulated-
bf16 CPUs' kernels too), by setting the dispatcher's decision points:

- linears: `native` (what this CPU picks: oneDNN prepacked bf16 with AVX512-BF16/AMX; for
  int8 `linear_bf16.cpp`'s int16 x int8 tiles with AVX512-VNNI, else `_weight_int8pack_mm`) or
  `widened` (bf16 weights widened to float32 in registers, `linear_bf16.cpp`; int8 codes widened
  to float32 by its tiles, its prefill-sized products dequantized in float32; the LM head's
  float32-output kernel widening too);
- attention: `kernel` (`paged_decode.cpp` / `paged_prefill.cpp`, decode keys split into tasks
  of 32), `gathered` (bf16 only: the decode kernel, and every prefill chunk one masked SDPA over
  its gathered keys, what CPUs with AMX pick for large chunks: `torch_paged.GATHER_FROM`) or
  `sdpa` (torch's SDPA: causal, after a cached prefix, masked decode; a lone sequence's decode
  split from 128 keys).

The schedule (`SCHEDULE`) runs two sequences through prefill and decode buckets: a 70-token
prefill (eager: past the largest bucket), prefill chunks after a cached prefix, mixed steps (a
decode beside a prefill chunk), a padded step, and one-token decodes to the end of the text:
compiled buckets 1, 4 and 16 (the same as `tests/test_compile.py`'s, so graphs are shared) and
the eager step. Every row's logits are kept (teacher forcing)
and compared with eager float32 over the same tokens (`agreement.agreement`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.attention import torch_paged
from engine.attention.torch_paged import TorchPagedBackend
from engine.model import head, linear, quant
from engine.model.compiled import CompiledStep, bucket_for
from engine.model.model import CausalLM
from engine.model_runner import Chunk, ModelRunner
from engine.verify.agreement import Agreement, agreement
from kvstore.block_pool import BlockPool
from kvstore.kv_cache import KVCache
from kvstore.spec import KVSpec

LINEARS = ("native", "widened")
ATTENTIONS = ("kernel", "gathered", "sdpa")


@dataclass(frozen=True)
class ServingPath:
    dtype: str = "bfloat16"  # float32 | bfloat16
    compiled: bool = True
    quantization: str = "none"  # none | int8 | int4
    linear: str = "native"  # LINEARS
    attention: str = "kernel"  # ATTENTIONS

    def __post_init__(self) -> None:
        assert self.linear in LINEARS and self.attention in ATTENTIONS, self
        assert self.dtype in ("float32", "bfloat16") and self.quantization in ("none", "int8", "int4"), self
        assert not (self.attention == "gathered" and self.dtype != "bfloat16"), self

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "float32" else torch.bfloat16

    @property
    def name(self) -> str:
        step = "compiled" if self.compiled else "eager"
        return f"{self.dtype}/{step}/{self.quantization}/{self.linear}/{self.attention}"


@contextlib.contextmanager
def forced(path: ServingPath) -> Iterator[None]:
    """While inside: models loaded take `path.linear`'s products, and runners made by `run_schedule`
    its attention. Restores the dispatcher on exit."""
    widened = path.linear == "widened"
    saved = (
        linear.bf16_emulated,
        quant.BF16_EMULATED,
        quant.FORCE_WIDENED,
        head.FORCE_WIDENED,
    )
    split, min_chunk = torch_paged.SPLIT_FROM, torch_paged.MIN_CHUNK
    gather = torch_paged.GATHER_FROM, torch_paged.GATHER_MIN_QUERIES
    try:
        if widened:
            linear.bf16_emulated = lambda: True  # type: ignore[assignment]
            quant.BF16_EMULATED = True
            quant.FORCE_WIDENED = True
            head.FORCE_WIDENED = True
        torch_paged.SPLIT_FROM = 128 if path.attention == "sdpa" else split
        torch_paged.MIN_CHUNK = 32
        torch_paged.GATHER_FROM = 1 if path.attention == "gathered" else None
        torch_paged.GATHER_MIN_QUERIES = 1
        yield
    finally:
        linear.bf16_emulated, quant.BF16_EMULATED, quant.FORCE_WIDENED, head.FORCE_WIDENED = saved  # type: ignore[assignment]
        torch_paged.SPLIT_FROM, torch_paged.MIN_CHUNK = split, min_chunk
        torch_paged.GATHER_FROM, torch_paged.GATHER_MIN_QUERIES = gather


# Steps of the schedule: per step, (sequence, tokens) chunks in order; sequence 0 is the text
# (TOKENS_A tokens), sequence 1 a second one (TOKENS_B), each chunk continuing its sequence.
TOKENS_A, TOKENS_B = 256, 64


def _schedule() -> list[list[tuple[int, int]]]:
    # 70 tokens (eager); 16 (a chunk after the cached prefix, and a first token); 4 (a chunk and
    # a decode); 16 (a decode and a 14-token chunk: 15, padded to 16)
    steps = [[(0, 70)], [(0, 15), (1, 1)], [(0, 3), (1, 1)], [(0, 1), (1, 14)]]
    a, b = 89, 16
    while a < TOKENS_A:
        if a % 16 == 0 and b < TOKENS_B:
            n = min(15, TOKENS_B - b)
            steps.append([(0, 1), (1, n)])  # a decode beside a prefill chunk: bucket 16
            b += n
        else:
            steps.append([(0, 1)])
        a += 1
    return steps


SCHEDULE = _schedule()


@dataclass(frozen=True)
class ScheduleRun:
    logits: torch.Tensor  # [rows, V] float32, every row of every step
    rows: list[tuple[int, int]]  # (sequence, position) of each row
    row_buckets: list[int | None]  # the bucket of each row's step (None: past the largest, eager)
    buckets: set[int]  # compiled buckets the steps ran (empty for eager)

    def by_bucket(self) -> dict[int | None, torch.Tensor]:
        """Row indices per step bucket."""
        out: dict[int | None, list[int]] = {}
        for i, b in enumerate(self.row_buckets):
            out.setdefault(b, []).append(i)
        return {b: torch.tensor(rows) for b, rows in out.items()}


def runner_for(model: CausalLM, compiled: bool, attention: str) -> ModelRunner:
    c = model.config
    norm = model.model.norm.weight
    dtype = str(norm.dtype).replace("torch.", "")
    pages = -(-TOKENS_A // 16) + -(-TOKENS_B // 16) + 2
    cache = KVCache(KVSpec(c.num_layers, model.local_kv_heads, c.head_dim, 16, dtype), pages, norm.device)
    backend = TorchPagedBackend(model.local_heads, model.local_kv_heads, c.head_dim)
    if attention == "sdpa":
        backend.kernel = None
    runner = ModelRunner(model, cache, backend)
    if compiled:
        runner.step = CompiledStep(model)
    return runner


@torch.inference_mode()
def run_schedule(
    model: CausalLM,
    path: ServingPath,
    seq_a: list[int],
    seq_b: list[int],
    schedule: list[list[tuple[int, int]]] = SCHEDULE,
) -> ScheduleRun:
    """The two sequences through `schedule` on `path`'s step and attention (call under `forced`)."""
    assert len(seq_a) >= TOKENS_A and len(seq_b) >= TOKENS_B
    runner = runner_for(model, path.compiled, path.attention)
    pool = BlockPool(runner.kv_cache.num_pages)
    seqs = (seq_a, seq_b)
    tables = (pool.allocate(-(-TOKENS_A // 16)), pool.allocate(-(-TOKENS_B // 16)))
    done = [0, 0]
    out, rows, row_buckets = [], [], []
    for step in schedule:
        tokens = sum(n for _, n in step)
        row_buckets += [bucket_for(tokens)] * tokens
        chunks = []
        for s, n in step:
            start = done[s]
            chunks.append(Chunk(seqs[s][start : start + n], tables[s], start + n))
            rows += [(s, p) for p in range(start, start + n)]
            done[s] += n
        out.append(runner.run(chunks, all_logits=True))
    buckets = set(runner.step.compiled_buckets) if isinstance(runner.step, CompiledStep) else set()
    return ScheduleRun(torch.cat(out).float(), rows, row_buckets, buckets)


@torch.inference_mode()
def reference(model: CausalLM, seq_a: list[int], seq_b: list[int]) -> dict[int, torch.Tensor]:
    """Eager float32 logits of each whole sequence (one chunk each, SDPA): {sequence: [T, V]}."""
    assert model.model.norm.weight.dtype == torch.float32
    runner = runner_for(model, False, "sdpa")
    pool = BlockPool(runner.kv_cache.num_pages)
    out = {}
    for s, ids in enumerate((seq_a[:TOKENS_A], seq_b[:TOKENS_B])):
        pages = pool.allocate(-(-len(ids) // 16))
        out[s] = runner.run([Chunk(ids, pages, len(ids))], all_logits=True).float()
        pool.free(pages)
    return out


def compare(run: ScheduleRun, ref: dict[int, torch.Tensor], dtype: torch.dtype) -> Agreement:
    """The run's rows against the reference's rows at the same (sequence, position)."""
    index = {s: torch.tensor([p for q, p in run.rows if q == s]) for s in ref}
    ref_rows = torch.empty_like(run.logits)
    for s, positions in index.items():
        mask = torch.tensor([q == s for q, _ in run.rows])
        ref_rows[mask] = ref[s][positions]
    return agreement(run.logits, ref_rows, dtype)
