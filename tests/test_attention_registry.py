"""Choosing an attention backend; the FlashInfer backend's glue (against a stand-in for
flashinfer 0.5.3's wrappers); and bench/gpu_check.py, which must run on torch alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import registry
from engine.attention.base import AttentionMetadata
from engine.attention.registry import choose_backend, make_backend
from engine.attention.torch_paged import TorchPagedBackend
from tests.server import ROOT

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_auto_on_cpu_is_torch_paged() -> None:
    assert choose_backend("auto", CPU) == "torch_paged"
    assert isinstance(make_backend("auto", CPU, 4, 2, 16), TorchPagedBackend)


def test_auto_on_cuda_prefers_flashinfer_when_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "flashinfer_available", lambda: True)
    assert choose_backend("auto", CUDA) == "flashinfer"
    monkeypatch.setattr(registry, "flashinfer_available", lambda: False)
    assert choose_backend("auto", CUDA) == "torch_paged"
    assert choose_backend("torch_paged", CUDA) == "torch_paged"


def test_flashinfer_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="flashinfer attention backend needs a CUDA device"):
        choose_backend("flashinfer", CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_backend("flashinfer", CPU, 4, 2, 16)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        choose_backend("flash", CPU)


def test_flashinfer_module_imports_without_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module itself never imports flashinfer; building the backend says how to get it."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    from engine.attention.flashinfer import FlashInferBackend

    with pytest.raises(RuntimeError, match=r"flashinfer-python 0\.5\.3.*torch_paged"):
        FlashInferBackend(4, 2, 16, device=CPU)


def test_attention_package_does_not_import_the_rest() -> None:
    code = (
        "import sys\n"
        "import engine.attention.registry, engine.attention.torch_paged, engine.attention.flashinfer\n"
        "bad = [m for m in ('transformers', 'safetensors', 'engine.model', 'kvstore', 'flashinfer')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --- FlashInferBackend against a stand-in flashinfer -------------------------------------


def _attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    qo_indptr: list[int],
    kv_indptr: list[int],
    kv_indices: list[int],
    last_page_len: list[int],
    window_left: int,
    sm_scale: float,
) -> torch.Tensor:
    """flashinfer's documented semantics, from its CSR page table: causal aligned to the end
    of each context, keys j >= pos - window_left kept (window_left -1 = all), float32 math."""
    S = cache.shape[2]
    out = torch.empty_like(q)
    for b in range(len(qo_indptr) - 1):
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
        kv_len = (len(pages) - 1) * S + last_page_len[b]
        keys = cache[pages, 0].reshape(-1, *cache.shape[3:])[:kv_len].float()  # [kv, KVH, D]
        values = cache[pages, 1].reshape(-1, *cache.shape[3:])[:kv_len].float()
        qb = q[qo_indptr[b] : qo_indptr[b + 1]].float()  # [n, H, D]
        group = q.shape[1] // cache.shape[3]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qb, keys) * sm_scale
        pos = torch.arange(kv_len - qb.shape[0], kv_len)[:, None]
        j = torch.arange(kv_len)[None, :]
        mask = (j <= pos) & ((j >= pos - window_left) if window_left >= 0 else True)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[qo_indptr[b] : qo_indptr[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


class _Wrapper:
    """Shared by the two stand-ins: records plans, checks run against them."""

    log: list[tuple[str, int]]

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kwargs: Any) -> None:
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.plan_args: dict[str, Any] | None = None

    def _planned(self, kind: str, host: dict[str, torch.Tensor], **args: Any) -> None:
        for name, t in host.items():  # flashinfer reads these on the host
            assert t.device.type == "cpu" and t.dtype == torch.int32, name
        self.plan_args = {k: v.tolist() for k, v in host.items()} | args
        self.log.append((kind, args["window_left"]))

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *args: Any, window_left: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        p = self.plan_args
        assert p is not None, "run before plan"
        assert q.dtype == p["q_data_type"] and paged_kv_cache.dtype == p["kv_data_type"]
        assert window_left is None or window_left == p["window_left"]
        assert q.shape[1:] == (p["num_qo_heads"], p["head_dim"])
        return _attend(
            q,
            paged_kv_cache,
            p["qo_indptr"],
            p["kv_indptr"],
            p["kv_indices"],
            p["last_page_len"],
            p["window_left"],
            p["sm_scale"],
        )


class _Prefill(_Wrapper):
    def plan(  # flashinfer 0.5.3's BatchPrefillWithPagedKVCacheWrapper.plan, first parameters
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: Any = None,
        packed_custom_mask: Any = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        non_blocking: bool = True,
    ) -> None:
        assert causal and custom_mask is None and pos_encoding_mode == "NONE"
        host = {"qo_indptr": qo_indptr, "kv_indptr": paged_kv_indptr, "last_page_len": paged_kv_last_page_len}
        self._planned(
            "prefill",
            host,
            kv_indices=paged_kv_indices.tolist(),
            num_qo_heads=num_qo_heads,
            head_dim=head_dim_qk,
            window_left=window_left,
            sm_scale=sm_scale,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
        )


class _Decode(_Wrapper):
    def plan(  # flashinfer 0.5.3's BatchDecodeWithPagedKVCacheWrapper.plan, first parameters
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        data_type: Any = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
    ) -> None:
        B = len(indptr) - 1
        host = {"kv_indptr": indptr, "last_page_len": last_page_len}
        self._planned(
            "decode",
            host,
            kv_indices=indices.tolist(),
            num_qo_heads=num_qo_heads,
            head_dim=head_dim,
            window_left=window_left,
            sm_scale=sm_scale,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
        )
        assert self.plan_args is not None
        self.plan_args["qo_indptr"] = list(range(B + 1))


@pytest.fixture()
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    log: list[tuple[str, int]] = []
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = type("P", (_Prefill,), {"log": log})  # type: ignore[attr-defined]
    module.BatchDecodeWithPagedKVCacheWrapper = type("D", (_Decode,), {"log": log})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return log


def _step(q_lens: list[int], kv_lens: list[int], H: int, KVH: int, D: int, S: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    pages = [-(-kv // S) for kv in kv_lens]
    perm = torch.randperm(sum(pages) + 2, generator=g).tolist()
    tables = [perm[sum(pages[:b]) : sum(pages[: b + 1])] for b in range(len(pages))]
    T = sum(q_lens)
    return {
        "meta": AttentionMetadata.build(tables, q_lens, kv_lens, S),
        "cache": torch.randn(sum(pages) + 2, 2, S, KVH, D, generator=g).bfloat16(),
        "qkv": [torch.randn(T, h, D, generator=g).bfloat16() for h in (H, KVH, KVH)],
    }


def test_flashinfer_backend_glue(fake_flashinfer: list[tuple[str, int]]) -> None:
    """Prefill, mixed and decode steps over two layers with different windows: one plan per
    window and step, decode wrappers only for all-decode steps, outputs as torch_paged's."""
    from engine.attention.flashinfer import FlashInferBackend

    H, KVH, D, S = 8, 2, 16, 4
    backend = FlashInferBackend(H, KVH, D, device=CPU)
    windows = [None, 5]  # layer 0 full, layer 1 windowed
    steps = [([9, 14], [9, 14]), ([6, 1, 1], [15, 23, 7]), ([1, 1, 1], [16, 24, 8]), ([1, 1, 1], [17, 25, 9])]
    expected_kinds = ["prefill", "prefill", "decode", "decode"]
    for i, ((q_lens, kv_lens), kind) in enumerate(zip(steps, expected_kinds, strict=True)):
        fake_flashinfer.clear()
        s = _step(q_lens, kv_lens, H, KVH, D, S, seed=i)
        backend.plan(s["meta"])
        ref = TorchPagedBackend(H, KVH, D)
        ref.plan(s["meta"])
        q, k, v = s["qkv"]
        for layer, window in enumerate(windows):
            cache = s["cache"].clone()
            out = backend.forward(layer, q, k, v, cache, window)
            ref_cache = s["cache"].float()
            expected = ref.forward(layer, q.float(), k.float(), v.float(), ref_cache, window)
            assert torch.equal(cache.float(), ref_cache), "new K/V written to their slots"
            err = float((out.float() - expected).abs().max() / expected.abs().max())
            assert err < 1e-2, f"step {i} layer {layer}: error {err:.2e}"
        assert sorted(fake_flashinfer) == sorted([(kind, -1), (kind, 4)]), fake_flashinfer  # window_left = w - 1
    assert len(backend._prefill) == 2 and len(backend._decode) == 2  # wrappers reused across steps


def test_flashinfer_backend_rejects_float32(fake_flashinfer: list[tuple[str, int]]) -> None:
    from engine.attention.flashinfer import FlashInferBackend

    backend = FlashInferBackend(4, 2, 16, device=CPU)
    s = _step([3], [3], 4, 2, 16, 4, seed=0)
    backend.plan(s["meta"])
    q, k, v = (t.float() for t in s["qkv"])
    with pytest.raises(ValueError, match=r"float16/bfloat16.*torch_paged"):
        backend.forward(0, q, k, v, s["cache"].float())


# --- bench/gpu_check.py -------------------------------------------------------------------

# Importing any of these fails in the subprocess: the script must need torch and engine.attention only.
BLOCKED = (
    "transformers",
    "safetensors",
    "xxhash",
    "tqdm",
    "msgspec",
    "gguf",
    "tokenizers",
    "kvstore",
    "engine.model.config",
    "engine.model.model",
    "engine.loading.weights",
)


def _run_gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import runpy, sys\n"
        f"for m in {BLOCKED!r}: sys.modules[m] = None\n"
        f"sys.argv = ['gpu_check.py', *{list(args)!r}]\n"
        "runpy.run_path('bench/gpu_check.py', run_name='__main__')\n"
    )
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_check_without_cuda_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _run_gpu_check("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert not out.exists()


def test_gpu_check_cpu_selftest(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _run_gpu_check("--cpu-selftest", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["complete"] is True
    rows = report["results"]
    assert {r["dtype"] for r in rows} == {"bfloat16", "float16"}
    assert {r["case"] for r in rows} >= {"prefill", "chunked", "decode", "mixed", "decode-window"}
    for r in rows:
        limit = {"bfloat16": 1e-2, "float16": 2e-3}[r["dtype"]]
        assert r["threshold"] == limit and 0 < r["error"] < limit and r["kv_written"] and r["ok"], r
    assert "passed, 0 failed" in proc.stdout and "chunked-window" in proc.stdout


def test_gpu_check_prebuild_without_flashinfer_says_so(tmp_path: Path) -> None:
    proc = _run_gpu_check("--prebuild", str(tmp_path / "aot"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "flashinfer-python 0.5.3" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "aot").exists()


def test_gpu_engine_rows_on_cpu() -> None:
    """The engine part of gpu_check, run here on CPU: our runner and `Engine` against transformers."""
    from bench.gpu_engine import engine_rows

    rows = engine_rows(torch.device("cpu"), ["torch_paged"], [torch.float32])
    assert len(rows) == 1 and rows[0]["ok"], rows
    assert rows[0]["error"] < 1e-4 and rows[0]["greedy_vs_first_backend"] == "8/8, 16.0"
    assert rows[0]["greedy_vs_float32"] == "8/8, 16.0"  # float32: transformers' greedy tokens exactly
    assert rows[0]["engine_tokens_per_s"] > 0
