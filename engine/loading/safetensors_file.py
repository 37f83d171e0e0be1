"""Reading safetensors files tensor by tensor, with plain reads instead of a memory map.

A memory-mapped checkpoint stays resident (and counted in RSS) beside the model it is
copied into, doubling peak memory; reading each tensor's bytes into a buffer once keeps
the peak at the model plus one tensor. The header is validated against the file's size
so that a truncated or corrupt file is named as such before any tensor is read.

The exception is a file already in the model's dtype and layout (a GGUF's conversion cache):
`map_tensor` maps each tensor copy-on-write, and the mapping becomes the parameter itself, so
nothing is read or copied up front and there is no second copy to double the peak.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, truncated, or does not fit the model."""


SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> list[TensorEntry]:
    """Parse and validate a safetensors header. Raises CheckpointError naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise CheckpointError(f"{path}: corrupt safetensors header length {n} (file has {size} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {e}") from e
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {list(shape)}")
        if base + end > size:
            raise CheckpointError(
                f"{path}: truncated file: tensor {name!r} ends at byte {base + end}, file has {size} bytes"
            )
        entries.append(TensorEntry(path, name, dtype, shape, base + begin, base + end))
    return entries


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """Read one tensor's bytes into a fresh CPU tensor."""
    out = torch.empty(entry.shape, dtype=entry.dtype)
    buf = out.view(torch.uint8).reshape(-1).numpy() if entry.nbytes else None
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start)
        got = f.readinto(buf) if buf is not None else 0  # type: ignore[arg-type]
    if got != entry.nbytes:
        raise CheckpointError(f"{entry.file}: truncated while reading tensor {entry.name!r}")
    return out


def map_tensor(entry: TensorEntry) -> torch.Tensor:
    """The tensor's bytes mapped from the file, private and copy-on-write: pages are read on
    first touch, a write never reaches the file, and the mapping ends with the last reference.
    Falls back to `read_tensor` for an empty tensor or an offset misaligned for its dtype."""
    if entry.nbytes == 0 or entry.start % entry.dtype.itemsize:
        return read_tensor(entry)
    base = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
    try:
        with open(entry.file, "rb") as f:
            mapped = mmap.mmap(
                f.fileno(), entry.end - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base
            )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{entry.file}: cannot map tensor {entry.name!r}: {e}") from e
    count = entry.nbytes // entry.dtype.itemsize
    return torch.frombuffer(mapped, dtype=entry.dtype, count=count, offset=entry.start - base).view(entry.shape)


def read_tensor_part(entry: TensorEntry, dim: int, ranges: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, int]:
    """Read only ranges of one dimension of a tensor, concatenated along it: (tensor, bytes read).

    In row-major order such a part is, for each index of the leading dimensions, one contiguous
    run per range (a row range of a matrix is a single run; a column range is one run per row);
    adjacent runs are merged and each is read with one `pread` straight into the result.
    """
    shape = entry.shape
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1 :]) * entry.dtype.itemsize
    out_shape = (*shape[:dim], sum(n for _, n in ranges), *shape[dim + 1 :])
    out = torch.empty(out_shape, dtype=entry.dtype)
    runs: list[list[int]] = []  # [file offset, length]
    for o in range(outer):
        for start, n in ranges:
            offset, length = entry.start + (o * shape[dim] + start) * inner, n * inner
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1][1] += length
            elif length:
                runs.append([offset, length])
    total = sum(length for _, length in runs)
    if total == 0:
        return out, 0
    view = memoryview(out.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
    fd = os.open(entry.file, os.O_RDONLY)
    try:
        pos = 0
        for offset, length in runs:
            done = 0
            while done < length:
                got = os.preadv(fd, [view[pos + done : pos + length]], offset + done)
                if got <= 0:
                    raise CheckpointError(f"{entry.file}: truncated while reading tensor {entry.name!r}")
                done += got
            pos += length
    finally:
        os.close(fd)
    return out, total


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (single file or sharded with an index)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: unreadable index: {e}") from e
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {', '.join(missing)}")
        return files
    files = sorted(p for p in directory.glob("*.safetensors") if os.path.getsize(p) >= 0)
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return files
