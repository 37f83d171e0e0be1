"""Choosing an attention backend: FlashInfer on CUDA when it imports, torch_paged otherwise."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend

BACKENDS = ("auto", "torch_paged", "flashinfer")


def flashinfer_available() -> bool:
    """Installed and importable (a broken install falls back to torch_paged under `auto`)."""
    if importlib.util.find_spec("flashinfer") is None:
        return False
    try:
        importlib.import_module("flashinfer")
    except Exception:
        return False
    return True


def choose_backend(name: str, device: torch.device) -> str:
    """Resolve `auto` to a concrete backend name for `device`; reject impossible choices."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch_paged"
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    return name


def make_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    resolved = choose_backend(name, device)
    if resolved == "flashinfer":
        from engine.attention.flashinfer import FlashInferBackend  # imported lazily: CUDA only

        return FlashInferBackend(num_heads, num_kv_heads, head_dim, device=device)
    from engine.attention.torch_paged import TorchPagedBackend

    return TorchPagedBackend(num_heads, num_kv_heads, head_dim)
