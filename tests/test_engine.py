"""The serving loop on a tiny random model: batching, chunked prefill, preemption, seeds, aborts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.engine import Engine, EngineConfig
from engine.request import ContextTooLong, FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from tests.tiny_models import build_tiny, one_thread, rel_error

_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)
LENGTHS = (5, 17, 33, 9, 48, 21, 2, 40)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("engine"), num_hidden_layers=3)


def _engine(tiny: Any, **kw: Any) -> Engine:
    cfg = EngineConfig(**({"kv_cache_bytes": 256 * _page_bytes(tiny), "max_num_batched_tokens": 64} | kw))
    return Engine(tiny.model, None, cfg)


def _page_bytes(tiny: Any, page_size: int = 16) -> int:
    c = tiny.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * page_size


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _params(i: int, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(max_tokens=32, temperature=0, logprobs=5, ignore_eos=True)
    return SamplingParams(max_tokens=32, temperature=1.0, top_p=0.9, seed=100 + i, logprobs=5, ignore_eos=True)


class LogitsTap:
    """Records, per request, the full logits [V] float32 each of its tokens was drawn from."""

    def __init__(self, engine: Engine):
        self.logits: dict[str, list[torch.Tensor]] = {}
        process = engine.output_processor

        def tapped(reqs: list[Any], logits: torch.Tensor) -> list[RequestOutput]:
            for r, row in zip(reqs, logits, strict=True):
                self.logits.setdefault(r.id, []).append(row.clone())
            return process(reqs, logits)

        engine.output_processor = tapped  # type: ignore[assignment]


def _run_all(engine: Engine, prompts: list[list[int]], greedy: bool) -> list[tuple[list[int], torch.Tensor]]:
    """Each request's token ids and the logits they were drawn from ([n, V])."""
    tap = LogitsTap(engine)
    handles = [engine.add_request(p, _params(i, greedy)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    return [(h.result()[0], torch.stack(tap.logits[h.id])) for h in handles]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_batched_equals_alone_and_preempted(tiny: Any, greedy: bool) -> None:
    prompts = _prompts(tiny.config.vocab_size)
    alone = []
    for i, p in enumerate(prompts):
        e = _engine(tiny)
        tap = LogitsTap(e)
        h = e.add_request(p, _params(i, greedy))
        e.run_until_idle()
        alone.append((h.result()[0], torch.stack(tap.logits[h.id])))

    batched_engine = _engine(tiny)
    batched = _run_all(batched_engine, prompts, greedy)
    assert batched_engine.runner.num_mixed_steps > 0  # prefill chunks and decodes shared passes

    # 12 pages of 16 tokens cannot hold 8 requests of up to 80 tokens: the newest are preempted.
    small = _engine(tiny, kv_cache_bytes=12 * _page_bytes(tiny))
    preempted = _run_all(small, prompts, greedy)
    assert small.scheduler.num_preemptions > 0

    # float32: the full logits of every drawn token agree, not only the top few.
    for (ids_a, lg_a), (ids_b, lg_b), (ids_c, lg_c) in zip(alone, batched, preempted, strict=True):
        assert len(ids_a) == 32 and lg_a.shape == (32, tiny.config.vocab_size)
        assert ids_a == ids_b == ids_c
        assert rel_error(lg_b, lg_a) < 1e-5
        assert rel_error(lg_c, lg_a) < 1e-5
    for e in (batched_engine, small):
        assert e.pool.num_free == e.pool.num_pages


def test_one_forward_pass_per_step_and_mixed_plan(tiny: Any) -> None:
    e = _engine(tiny, max_num_batched_tokens=16)
    prompts = _prompts(tiny.config.vocab_size)
    e.add_request(prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    e.step()  # prefill of the 5-token prompt
    e.add_request(prompts[4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    calls = e.runner.num_forward_calls
    e.step()
    assert e.runner.num_forward_calls == calls + 1
    assert e.runner.last_plan == (1, 1)  # one prefill chunk (of 15 tokens) + one decode token
    assert e.runner.num_tokens_computed == 5 + 16
    e.run_until_idle()
    assert e.runner.num_forward_calls == e.stats.steps


def test_context_too_long_is_immediate(tiny: Any) -> None:
    e = _engine(tiny, kv_cache_bytes=4 * _page_bytes(tiny))
    with pytest.raises(ContextTooLong, match="64 tokens") as err:
        e.add_request([1] * 60, SamplingParams(max_tokens=10))
    assert err.value.needed == 70 and err.value.limit == 64
    with pytest.raises(ContextTooLong, match="model's context of 512"):
        _engine(tiny, kv_cache_bytes=64 * _page_bytes(tiny)).add_request([1] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        e.add_request([tiny.config.vocab_size], SamplingParams())


def test_stop_token_ids_and_max_tokens(tiny: Any) -> None:
    e = _engine(tiny)
    p = _prompts(tiny.config.vocab_size)[1]
    h = e.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    e.run_until_idle()
    ids, _, reason = h.result()
    assert len(ids) == 12 and reason == FinishReason.LENGTH
    h = e.add_request(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(ids[3],), ignore_eos=True))
    e.run_until_idle()
    ids2, _, reason2 = h.result()
    assert reason2 == FinishReason.STOP and ids2 == ids[: ids.index(ids[3])]


def test_async_consumers_with_abort(tiny: Any, tmp_path: Path) -> None:
    engine = _engine(tiny, max_num_batched_tokens=32).start()
    prompts = _prompts(tiny.config.vocab_size)

    async def consume(i: int) -> tuple[int, FinishReason | None]:
        params = SamplingParams(max_tokens=400 if i == 3 else 24, temperature=0, ignore_eos=True)
        handle = engine.add_request(prompts[i], params)
        n, reason = 0, None
        async for out in handle:
            n += len(out.token_ids)
            reason = out.finish_reason
            if i == 3 and n >= 5 and reason is None:
                engine.abort(handle.id)  # from async code, mid-stream
        return n, reason

    async def main() -> list[tuple[int, FinishReason | None]]:
        return await asyncio.gather(*(consume(i) for i in range(8)))

    try:
        results = asyncio.run(asyncio.wait_for(main(), timeout=120))
    finally:
        engine.shutdown()
    for i, (n, reason) in enumerate(results):
        if i == 3:
            assert reason == FinishReason.ABORT and 5 <= n < 400
        else:
            assert (n, reason) == (24, FinishReason.LENGTH)
    assert engine.pool.num_free == engine.pool.num_pages
    assert all(c == 0 for c in engine.pool.ref_counts)


def test_blocking_iteration_from_threads(tiny: Any) -> None:
    import concurrent.futures

    engine = _engine(tiny).start()
    prompts = _prompts(tiny.config.vocab_size)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            futs = [ex.submit(lambda p: engine.add_request(p, params).result(), p) for p in prompts[:4]]
            results = [f.result(timeout=60) for f in futs]
    finally:
        engine.shutdown()
    assert all(len(ids) == 8 and reason == FinishReason.LENGTH for ids, _, reason in results)
