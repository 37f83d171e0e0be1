"""What a GGUF file converts to, kept beside it so the next load skips the conversion.

Every load of a GGUF pays for conversions whose results never change: transformers rebuilds
the tokenizer from the GGUF vocabulary (about 5 s for the demo model on two busy cores),
gguf-py parses the metadata (about 3 s), and every tensor is dequantized (about 2 s). The
first load writes their results into a directory beside the file,

    <dir>/.longctx-cache/<file name>-<size>-<mtime_ns>/
        config.json                  our ModelConfig (msgspec JSON, not transformers' config.json)
        tokenizer/                   `save_pretrained` of the converted tokenizer
        weights-float32/model.safetensors   the dequantized tensors under transformers' names
        weights-bfloat16/model.safetensors  the same converted to the dtype a load ran in
        fingerprint                  the weights' fingerprint (`LoadStats.fingerprint`)

and later loads read those instead. The key holds the file's size and mtime: a replaced
file gets a new directory. Each part is written under a temporary name and renamed, so a
load never sees half a cache (two servers starting together both write; one rename wins).
The float32 tensors are exactly what the GGUF source yields, so their fingerprint is the
GGUF's; a load from the weights of another dtype (which skips the float32 read and the
conversion) takes the recorded fingerprint, so the KV namespace is the same either way.
Weights are cached only up to `MAX_WEIGHT_CACHE_BYTES` of float32 (a 7B model's would be
28 GB). While converting, the float32 tensors are kept until the end of the load: the first
load's peak memory is the model plus that copy. A cache that cannot be written (read-only
directory, full disk) is logged and skipped.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import torch

from engine.loading.weights import SourceTensor, TensorSource
from engine.model.config import ModelConfig

log = logging.getLogger("longctx.gguf_cache")

MAX_WEIGHT_CACHE_BYTES = 4 << 30
WEIGHTS = "model.safetensors"


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def plain_permissions(path: Path) -> None:
    """Permissions as a plain write would give (some writers create 0600 files): others on the
    machine load the same model."""
    umask = _umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


class GGUFCache:
    """The cache directory of one GGUF file."""

    def __init__(self, gguf: Path):
        st = gguf.stat()
        self.gguf = gguf
        self.dir = gguf.parent / ".longctx-cache" / f"{gguf.name}-{st.st_size}-{st.st_mtime_ns}"
        self.config_file = self.dir / "config.json"
        self.tokenizer_dir = self.dir / "tokenizer"
        self.fingerprint_file = self.dir / "fingerprint"

    def weights_dir(self, dtype: torch.dtype = torch.float32) -> Path:
        return self.dir / f"weights-{str(dtype).removeprefix('torch.')}"

    # ---- reading ----

    def config(self) -> ModelConfig | None:
        try:
            return msgspec.json.decode(self.config_file.read_bytes(), type=ModelConfig)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
            return None

    def has_tokenizer(self) -> bool:
        return (self.tokenizer_dir / "tokenizer_config.json").exists()

    def has_weights(self, dtype: torch.dtype = torch.float32) -> bool:
        return (self.weights_dir(dtype) / WEIGHTS).exists()

    def fingerprint(self) -> str | None:
        try:
            return self.fingerprint_file.read_text().strip() or None
        except OSError:
            return None

    # ---- writing ----

    def _write(self, target: Path, write: Any) -> None:
        """Write `target` (a file or directory) through `write(tmp_path)`, then rename it into place."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".part-", dir=self.dir))
            try:
                write(tmp / target.name)
                plain_permissions(tmp / target.name)
                if not target.exists():  # else another process cached it meanwhile
                    os.replace(tmp / target.name, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as e:  # a cache that cannot be written must never fail the load
            log.warning("cannot cache %s beside %s: %s", target.name, self.gguf, e)

    def save_config(self, config: ModelConfig) -> None:
        self._write(self.config_file, lambda p: p.write_bytes(msgspec.json.encode(config)))

    def save_tokenizer(self, hf_tokenizer: Any) -> None:
        self._write(self.tokenizer_dir, lambda p: hf_tokenizer.save_pretrained(str(p)))

    def save_weights(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        """Cache `tensors` (float32, as the GGUF yields them) converted to `dtype`."""
        from safetensors.torch import save_file

        def write(p: Path) -> None:
            p.mkdir()
            save_file({k: v.to(dtype) for k, v in tensors.items()}, str(p / WEIGHTS))

        self._write(self.weights_dir(dtype), write)

    def save_fingerprint(self, fingerprint: str) -> None:
        self._write(self.fingerprint_file, lambda p: p.write_text(fingerprint + "\n"))


class TeeSource:
    """A GGUF `TensorSource` that keeps a copy of every tensor it reads, to be cached afterwards."""

    def __init__(self, source: TensorSource, budget_bytes: int = MAX_WEIGHT_CACHE_BYTES):
        self.source = source
        self.description = source.description
        self.kept: dict[str, torch.Tensor] = {}
        self.budget = budget_bytes
        self.complete = True  # False once a tensor was skipped: the cache would be partial

    def tensors(self) -> Iterator[SourceTensor]:
        for t in self.source.tensors():
            yield replace(t, read=self._keeping(t), read_part=None)

    def _keeping(self, t: SourceTensor) -> Any:
        def read() -> torch.Tensor:
            value = t.read()
            size = value.numel() * value.element_size()
            if self.complete and size <= self.budget:
                self.budget -= size
                self.kept[t.name] = value.contiguous()
            else:
                self.complete, self.kept = False, {}
            return value

        return read
