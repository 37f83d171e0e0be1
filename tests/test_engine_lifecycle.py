"""The serving loop when things go wrong: a failure ends its own request only, shutdown and
consumers that leave abort what they started, and outputs stay aligned with what is emitted."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.engine import Engine, EngineConfig
from engine.request import EngineClosed, FinishReason, RequestHandle, RequestOutput
from engine.sampling.output_processor import DEAD_END
from engine.sampling_params import SamplingParams
from tests.tiny_models import build_tiny, one_thread

_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)
LENGTHS = (5, 17, 33, 9, 48, 21, 12, 40)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("lifecycle"), num_hidden_layers=2)


def _engine(tiny: Any, pages: int = 256, **kw: Any) -> Engine:
    c = tiny.config
    page_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16
    return Engine(tiny.model, None, EngineConfig(kv_cache_bytes=pages * page_bytes, max_num_batched_tokens=64, **kw))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2, **kw)


def _ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _check_outputs(handle: RequestHandle, outs: list[RequestOutput]) -> None:
    """Every output names its request, logprobs align with ids, exactly one final output, last."""
    assert all(o.request_id == handle.id for o in outs)
    assert all(o.logprobs is None or len(o.logprobs) == len(o.token_ids) for o in outs)
    assert [o.finish_reason is not None for o in outs] == [False] * (len(outs) - 1) + [True]


class DeadEnd:
    """A matcher that allows every token for `after` tokens, then none."""

    def __init__(self, after: int):
        self.after, self.accepted = after, 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.accepted >= self.after:
            bitmask[row] = 0

    def accept_token(self, token_id: int) -> bool:
        self.accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.accepted -= num_tokens

    def is_terminated(self) -> bool:
        return False


class Rejects(DeadEnd):
    """Allows every token in its mask, but rejects the `after`-th one it is given."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        pass

    def accept_token(self, token_id: int) -> bool:
        self.accepted += 1
        return self.accepted <= self.after


class Raises(DeadEnd):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise RuntimeError("matcher state corrupted")


def test_one_failure_fails_one_request(tiny: Any) -> None:
    """A dead-ended grammar and a consumer whose event loop closed end in error; the other six
    requests of the same batches finish exactly as they do without the two."""
    prompts = _prompts(tiny.config.vocab_size)
    e = _engine(tiny)
    dead = e.add_request(prompts[0], _greedy(40), matcher=DeadEnd(after=4))
    gone = e.add_request(prompts[1], _greedy(40))
    normal = [e.add_request(p, _greedy()) for p in prompts[2:]]
    while e.stats.generated_tokens < 3 * 8:  # a few tokens each
        e.step()
    loop = asyncio.new_event_loop()
    stream = gone.__aiter__()
    seen = [loop.run_until_complete(stream.__anext__()) for _ in range(3)]
    loop.close()  # the consumer's loop is gone while its request still generates
    e.run_until_idle()

    dead_outs, gone_outs = list(dead), seen + list(gone)
    for h, outs in ((dead, dead_outs), (gone, gone_outs)):
        _check_outputs(h, outs)
        assert outs[-1].finish_reason == FinishReason.ERROR
    assert dead_outs[-1].error == DEAD_END and len(_ids(dead_outs)) == 4
    assert "gone" in (gone_outs[-1].error or "") and 3 <= len(_ids(gone_outs)) < 40

    alone = _engine(tiny)
    expected = [alone.add_request(p, _greedy()) for p in prompts[2:]]
    alone.run_until_idle()
    for h, ref in zip(normal, expected, strict=True):
        outs, ref_outs = list(h), list(ref)
        _check_outputs(h, outs)
        assert outs[-1].finish_reason == FinishReason.LENGTH and _ids(outs) == _ids(ref_outs)
        lps = torch.tensor([lp.logprob for o in outs for lp in o.logprobs or []])
        ref_lps = torch.tensor([lp.logprob for o in ref_outs for lp in o.logprobs or []])
        assert torch.allclose(lps, ref_lps, atol=1e-4)
    assert e.stats.finished_by_reason == {"error": 2, "length": 6}
    assert e.pool.num_free == e.pool.num_pages


def test_raising_matcher_and_forward_fault(tiny: Any) -> None:
    """A matcher that raises ends its request alone; a fault in the forward pass gives every
    request in flight an error output, and the engine serves the next request."""
    prompts = _prompts(tiny.config.vocab_size)
    e = _engine(tiny)
    bad = e.add_request(prompts[0], _greedy(), matcher=Raises(after=0))
    good = e.add_request(prompts[1], _greedy())
    e.run_until_idle()
    assert "matcher state corrupted" in (list(bad)[-1].error or "")
    assert good.result()[2] == FinishReason.LENGTH

    run = e.runner.run
    calls = 0

    def faulty(chunks: Any, all_logits: bool = False) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run(chunks, all_logits)

    e.runner.run = faulty  # type: ignore[method-assign, assignment]
    handles = [e.add_request(p, _greedy()) for p in prompts[:4]]
    e.run_until_idle()
    for h in handles:
        outs = list(h)
        _check_outputs(h, outs)
        assert outs[-1].finish_reason == FinishReason.ERROR and "illegal memory access" in (outs[-1].error or "")
    assert e.pool.num_free == e.pool.num_pages
    after = e.add_request(prompts[5], _greedy())
    e.run_until_idle()
    assert after.result()[2] == FinishReason.LENGTH


def _slow(engine: Engine, seconds: float = 0.02) -> None:
    """Each forward pass takes at least `seconds`, so requests are still open when the test acts."""
    run = engine.runner.run

    def slow(chunks: Any, all_logits: bool = False) -> torch.Tensor:
        time.sleep(seconds)
        return run(chunks, all_logits)

    engine.runner.run = slow  # type: ignore[method-assign, assignment]


def test_shutdown_aborts_blocking_and_async_consumers(tiny: Any) -> None:
    prompts = _prompts(tiny.config.vocab_size)
    e = _engine(tiny)
    _slow(e)
    e.start()
    handles = [e.add_request(p, _greedy(400)) for p in prompts[:4]]
    results: dict[int, list[RequestOutput]] = {}
    started = threading.Barrier(5, timeout=30)

    def blocking(i: int) -> None:
        outs: list[RequestOutput] = []
        for out in handles[i]:
            if not outs:
                started.wait()
            outs.append(out)
        results[i] = outs

    async def consume(i: int) -> None:
        outs: list[RequestOutput] = []
        async for out in handles[i]:
            if not outs:
                await asyncio.to_thread(started.wait)
            outs.append(out)
        results[i] = outs

    async def two() -> None:
        await asyncio.gather(consume(2), consume(3))

    threads = [threading.Thread(target=blocking, args=(i,)) for i in (0, 1)]
    threads.append(threading.Thread(target=asyncio.run, args=(two(),)))
    for t in threads:
        t.start()
    started.wait()  # every consumer has its first token
    e.shutdown()
    deadline = time.monotonic() + 10
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads)
    for i, h in enumerate(handles):
        _check_outputs(h, results[i])
        assert results[i][-1].finish_reason == FinishReason.ABORT and len(_ids(results[i])) < 400
    assert e.pool.num_free == e.pool.num_pages
    with pytest.raises(EngineClosed):
        e.add_request(prompts[0], _greedy())


def _wait_for(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_consumer_that_leaves_aborts_its_request(tiny: Any) -> None:
    """break out of `async for`, a cancelled task, leaving `async with engine.generate(...)`,
    and break out of a blocking `for`: each request finishes with abort and frees its pages."""
    prompts = _prompts(tiny.config.vocab_size)
    e = _engine(tiny)
    _slow(e)
    e.start()

    async def breaks() -> None:
        async for out in e.add_request(prompts[0], _greedy(400)):
            if out.token_ids:
                break

    async def cancelled() -> None:
        got = asyncio.Event()

        async def consume() -> None:
            async for _ in e.add_request(prompts[1], _greedy(400)):
                got.set()

        task = asyncio.create_task(consume())
        await got.wait()
        task.cancel()

    async def leaves_block() -> None:
        async with e.generate(prompts[2], _greedy(400)) as handle:
            async for out in handle:
                if out.token_ids:
                    break  # leaves the loop, then the block; no reference games

    try:
        for n, scenario in enumerate((breaks, cancelled, leaves_block), start=1):
            asyncio.run(scenario())
            assert _wait_for(lambda n=n: e.stats.finished_by_reason.get("abort", 0) == n), scenario.__name__
        for _out in e.add_request(prompts[3], _greedy(400)):
            break
        assert _wait_for(lambda: e.stats.finished_by_reason.get("abort", 0) == 4)
        assert _wait_for(lambda: e.pool.num_free == e.pool.num_pages)
    finally:
        e.shutdown()
    assert e.stats.generated_tokens < 4 * 100  # nobody kept generating for nobody


def test_final_output_has_no_logprob_for_an_unemitted_token(tiny: Any) -> None:
    prompts = _prompts(tiny.config.vocab_size)
    e = _engine(tiny)
    ref = e.add_request(prompts[1], _greedy(12))
    e.run_until_idle()
    ids = ref.result()[0]
    stop = ids[5]
    first = ids.index(stop)

    h = e.add_request(prompts[1], _greedy(12, stop_token_ids=(stop,)))
    e.run_until_idle()
    outs = list(h)
    _check_outputs(h, outs)
    assert _ids(outs) == ids[:first] and outs[-1].finish_reason == FinishReason.STOP
    assert outs[-1].token_ids == [] and outs[-1].logprobs is None

    model = tiny.model
    saved = model.config
    model.config = dataclasses.replace(saved, eos_token_ids=(stop,))
    try:
        eos = _engine(tiny)
    finally:
        model.config = saved
    h = eos.add_request(prompts[1], SamplingParams(max_tokens=12, temperature=0, logprobs=2))
    eos.run_until_idle()
    outs = list(h)
    _check_outputs(h, outs)
    assert _ids(outs) == ids[:first] and outs[-1].finish_reason == FinishReason.STOP
    assert outs[-1].logprobs is None and sum(len(o.logprobs or []) for o in outs) == first


def test_grammar_rejected_token_is_never_emitted(tiny: Any) -> None:
    prompts = _prompts(tiny.config.vocab_size)
    e = _engine(tiny)
    ref = e.add_request(prompts[2], _greedy(12))
    e.run_until_idle()
    ids = ref.result()[0]
    h = e.add_request(prompts[2], _greedy(12), matcher=Rejects(after=3))
    e.run_until_idle()
    outs = list(h)
    _check_outputs(h, outs)
    assert _ids(outs) == ids[:3] and outs[-1].token_ids == [] and outs[-1].logprobs is None
    assert outs[-1].finish_reason == FinishReason.ERROR and "rejected" in (outs[-1].error or "")


def test_latency_histograms_and_counters(tiny: Any) -> None:
    e = _engine(tiny)
    handles = [e.add_request(p, _greedy(8)) for p in _prompts(tiny.config.vocab_size)]
    dup = e.add_request([1, 2, 3], _greedy(8), request_id=handles[0].id)
    e.run_until_idle()
    assert list(dup)[-1].request_id == handles[0].id
    s = e.stats.snapshot()
    assert s.generated_tokens == 64 and s.finished_by_reason == {"length": 8}
    assert s.prompt_tokens_computed == sum(LENGTHS)
    assert s.ttft.samples == s.queue_time.samples == s.e2e.samples == 8
    assert s.inter_token.samples == 8 * 7 and s.inter_token.cumulative[-1] == 56
