"""int4 codes kept on disk (`engine/loading/int4_cache.py`): the codes a load chose come back
bit for bit, under a key of everything that chose them, and a second int4 load of the same
checkpoint chooses none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import engine.loading.int4_cache as int4_cache
from engine.loading.gguf_cache import _umask
from engine.loading.loader import load
from engine.model import quant
from engine.model.quant import QuantLinear, int4_codes, pack_nibbles, unpack_nibbles
from tests.load_caches import caches_in, counted


def _weight_and_hessian() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    x = torch.randn(512, 256)
    hessian = torch.stack([x[:, i : i + 128].T @ x[:, i : i + 128] for i in range(0, 256, 128)])  # [K/128, 128, 128]
    return w, hessian


def test_nibbles_round_trip() -> None:
    q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    packed = pack_nibbles(q)
    assert packed.shape == (16, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed).int(), q)


def test_codes_stored_read_back_and_keyed_by_what_chooses_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w, hessian = _weight_and_hessian()
    cache = int4_cache.Int4CodesCache(tmp_path)
    want = int4_codes(w, 64, torch.bfloat16, hessian)
    for _ in range(2):  # chosen and stored, then read back
        q, sz = cache.codes(w, 64, torch.bfloat16, hessian)
        assert torch.equal(q, want[0]) and torch.equal(sz, want[1]) and q.dtype == torch.int32
    assert (cache.misses, cache.hits) == (1, 1)
    (stored,) = tmp_path.glob("*.safetensors")
    assert stored.stat().st_mode & 0o777 == 0o666 & ~_umask()  # others on the machine load it too

    nudged = w.clone()
    nudged[3, 7] += 1e-3
    others = [(nudged, 64, torch.bfloat16, hessian), (w, 128, torch.bfloat16, hessian), (w, 64, torch.float32, hessian),
              (w, 64, torch.bfloat16, None), (w, 64, torch.bfloat16, hessian * 2)]  # fmt: skip
    for args in others:
        q, sz = cache.codes(*args)
        expected = int4_codes(*args)
        assert torch.equal(q, expected[0]) and torch.equal(sz, expected[1])
    assert (cache.misses, cache.hits) == (6, 1) and len(list(tmp_path.glob("*.safetensors"))) == 6

    stored.write_bytes(b"not a safetensors file")
    with caplog.at_level("WARNING", logger="longctx.int4_cache"):
        q, sz = cache.codes(w, 64, torch.bfloat16, hessian)
    assert "cannot read the int4 codes" in caplog.text
    assert torch.equal(q, want[0]) and torch.equal(sz, want[1])
    assert int4_cache.Int4CodesCache(tmp_path).codes(w, 64, torch.bfloat16, hessian)[0].equal(want[0])  # rewritten


def test_a_second_int4_load_chooses_no_codes(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Calibrated int4 at group 64 through `load`: the second load reads every weight's codes
    (`int4_codes` is not called) and computes with the same weights as the first."""
    caches_in(monkeypatch, tmp_path)
    calls = counted(monkeypatch, quant, "int4_codes")

    def load_int4() -> Any:
        return load(str(tiny_model), dtype="float32", progress=False, quantization="int4", group_size=64)

    first = load_int4()
    chosen = len(calls)
    int4_layers = [m for m in first.model.modules() if isinstance(m, QuantLinear) and m.mode == "int4"]
    assert chosen == len(int4_layers) > 0
    with caplog.at_level("INFO", logger="longctx.loader"):
        again = load_int4()
    assert len(calls) == chosen, "codes were chosen again"
    assert f"int4 codes: {chosen} read from" in caplog.text and ", 0 chosen" in caplog.text
    assert again.stats.fingerprint == first.stats.fingerprint
    for a, b in zip(first.model.modules(), again.model.modules(), strict=True):
        if isinstance(a, QuantLinear):
            assert isinstance(b, QuantLinear)
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)


def test_trim_drops_the_least_recently_used_beyond_the_budget(tmp_path: Path) -> None:
    """Four entries over a budget of two: the two least recently used go (a read counts as a
    use), a temporary file a dead writer left goes once stale, one being written stays."""
    import os
    import time

    torch.manual_seed(1)
    weights = [torch.randn(16, 64) for _ in range(4)]
    cache = int4_cache.Int4CodesCache(tmp_path, budget=0)
    for w in weights:
        cache.codes(w, 64)
    paths = [cache.path(int4_cache.codes_key(w, 64, torch.float32, None)) for w in weights]
    size = paths[0].stat().st_size
    assert all(p.stat().st_size == size for p in paths)
    old = time.time() - 7200
    for i, p in enumerate(paths):  # written in order, an hour or two ago
        os.utime(p, (old + i, old + i))
    stale, fresh = tmp_path / ".part-dead.safetensors", tmp_path / ".part-live.safetensors"
    stale.write_bytes(b"x" * 10)
    fresh.write_bytes(b"y" * 10)
    os.utime(stale, (old, old))

    assert cache.trim() == 10  # no budget: only the stale temporary file
    assert all(p.exists() for p in paths) and not stale.exists() and fresh.exists()
    cache.codes(weights[0], 64)  # a hit: the oldest entry is now the most recent
    assert cache.hits == 1
    cache.budget = 2 * size + size // 2
    assert cache.trim() == 2 * size
    assert [p.exists() for p in paths] == [True, False, False, True] and fresh.exists()
    assert cache.trim() == 0  # within the budget now


def test_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(int4_cache.BUDGET_ENV, raising=False)
    assert int4_cache.budget_bytes() == 32 << 30
    for text, want in (("123", 123), ("0", 0), (" 5000000 ", 5_000_000)):
        monkeypatch.setenv(int4_cache.BUDGET_ENV, text)
        assert int4_cache.budget_bytes() == want
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv(int4_cache.BUDGET_ENV, bad)
        with caplog.at_level("WARNING", logger="longctx.int4_cache"):
            assert int4_cache.budget_bytes() == 32 << 30
        assert int4_cache.BUDGET_ENV in caplog.text
