"""Tensors kept in safetensors files under a cache directory: read back whole, or written under a
temporary name and renamed, so that a reader sees a whole file or none (two processes writing
the same key at once both write; one rename wins). A file that cannot be read or written is the
caller's to log: a cache never fails a load."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from engine.loading.gguf_cache import plain_permissions


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """(tensors by name, metadata) of the file at `path`; None when there is none. Raises what
    safetensors raises for a damaged file."""
    if not path.exists():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return {name: f.get_tensor(name) for name in f.keys()}, dict(meta)  # noqa: SIM118 (safe_open has no __iter__)


def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Store `tensors` at `path` atomically, with the permissions a plain write gives (others on
    the machine load the same model)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".part-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, tmp, metadata=metadata)
        plain_permissions(Path(tmp))  # mkstemp makes it 0600
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
