"""Batched greedy generation over the paged cache: the simple loop behind `longctx generate`.

Each prompt is prefilled whole, then all sequences decode together one token per step
until they stop. The serving loop (`engine/engine.py`) adds scheduling and sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.model_runner import Chunk, ModelRunner
from kvstore.block_pool import BlockPool


@dataclass
class _Seq:
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


def greedy_generate(
    runner: ModelRunner,
    pool: BlockPool,
    prompts: list[list[int]],
    max_tokens: int,
    eos_token_ids: tuple[int, ...] = (),
) -> list[list[int]]:
    """Returns each prompt's generated ids (eos excluded). Pages are freed on return."""
    page_size = runner.kv_cache.spec.page_size
    seqs = [_Seq(list(p)) for p in prompts]
    try:
        for s in seqs:
            if not s.prompt:
                raise ValueError("empty prompt")
            s.pages = pool.allocate(-(-s.length // page_size))
        chunks = [Chunk(s.prompt, s.pages, s.length) for s in seqs]
        while True:
            active = [s for s in seqs if not s.done]
            if not active or max_tokens == 0:
                break
            next_ids = runner.run(chunks).argmax(dim=-1).tolist()
            chunks = []
            for s, tok in zip(active, next_ids, strict=True):
                if tok in eos_token_ids:
                    s.done = True
                    continue
                s.output.append(tok)
                if len(s.output) >= max_tokens:
                    s.done = True
                    continue
                if s.length > len(s.pages) * page_size:
                    s.pages += pool.allocate(1)
                chunks.append(Chunk([tok], s.pages, s.length))
    finally:
        for s in seqs:
            pool.free(s.pages)
    return [s.output for s in seqs]
