"""int4 codes kept on disk, so that a later load of the same weights skips choosing them.

Choosing a float weight's int4 codes (`engine.model.quant.int4_codes`: the clipping and
least-squares search per group, then with a calibration the error-compensating pass) is the
bulk of a `--quantization int4` load at group 64 or 128: on the demo model 12 s of the 14 s
load at one thread of a 2-core AVX2 EPYC, minutes on a large model, at every start. The codes
depend only on the weight, the group, the dtype its scales are rounded to, the calibration
statistics it was given and the quantizer's code, so they are kept by a hash of those:

    $LONGCTX_HOME/int4/<key>.safetensors   `codes` [N, K/2] uint8 (two 4-bit codes a byte, the
                                           low nibble first), `scale_zeros` [K/g, N, 2] float32

Content-addressed, so a weight shared by two models, or the same slice on a rank of a sharded
load, finds the same entry, and a changed weight or quantizer a new one. Hashing a weight
costs a pass over its bytes (~0.1 s for the demo model's). An entry takes about 0.6 bytes per
parameter at group 64 (its codes and its float32 scales and zeros), so a few large models fill a
disk: after each load the directory is trimmed to `LONGCTX_INT4_CACHE_BYTES` (default 32 GiB; 0
keeps everything), the least recently used entries first (a read refreshes an entry's time),
and a temporary file a killed writer left behind goes once it is an hour old. A file that
cannot be read or written is logged and the codes are chosen again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch
import xxhash

from engine.loading import tensor_files
from engine.loading.model_source import longctx_home
from engine.model import int4_calibrated, quant

log = logging.getLogger("longctx.int4_cache")

_CODE = (Path(quant.__file__), Path(int4_calibrated.__file__))
DEFAULT_BUDGET = 32 << 30
BUDGET_ENV = "LONGCTX_INT4_CACHE_BYTES"
STALE_PART_S = 3600  # a temporary file older than this was left by a writer that died


def budget_bytes() -> int:
    """The directory's byte budget: `LONGCTX_INT4_CACHE_BYTES` (0: no limit), else 32 GiB."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return DEFAULT_BUDGET
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        log.warning("%s=%r is not a byte count (0 or more): using %d", BUDGET_ENV, text, DEFAULT_BUDGET)
        return DEFAULT_BUDGET
    return value


def _tensor(h: xxhash.xxh3_128, t: torch.Tensor | None) -> None:
    if t is None:
        h.update(b"none\0")
        return
    h.update(f"{t.dtype}:{tuple(t.shape)}\0".encode())
    h.update(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().data)


def codes_key(w: torch.Tensor, group: int, dtype: torch.dtype, hessian: torch.Tensor | None) -> str:
    """The key of one weight's codes: what `int4_codes` computes them from."""
    h = xxhash.xxh3_128()
    h.update(f"{quant.INT4_QUANTIZER}:{group}:{dtype}:{torch.__version__}\0".encode())
    for code in _CODE:
        h.update(code.read_bytes())
    _tensor(h, w)
    _tensor(h, hessian)
    return h.hexdigest()


class Int4CodesCache:
    """The int4 codes under `root` (default `$LONGCTX_HOME/int4`); `codes` stands in for
    `int4_codes`. Counts what it found and what it chose (`hits`, `misses`)."""

    def __init__(self, root: Path | None = None, budget: int | None = None):
        self.root = root if root is not None else longctx_home() / "int4"
        self.budget = budget_bytes() if budget is None else budget
        self.hits = self.misses = 0

    def path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def codes(
        self, w: torch.Tensor, group: int, dtype: torch.dtype = torch.float32, hessian: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`int4_codes(w, group, dtype, hessian)`, read from the cache when it holds them, else
        chosen and stored."""
        key = codes_key(w, group, dtype, hessian)
        path = self.path(key)
        try:
            found = tensor_files.read(path)
        except Exception as e:  # a damaged file costs choosing the codes again, never the load
            log.warning("cannot read the int4 codes %s (%s): choosing them again", path, e)
            found = None
        if found is not None:
            tensors, _ = found
            q, sz = quant.unpack_nibbles(tensors["codes"]).int(), tensors["scale_zeros"]
            if q.shape == w.shape and sz.shape == (w.shape[1] // group, w.shape[0], 2):
                self.hits += 1
                with contextlib.suppress(OSError):
                    os.utime(path)  # recently used: the last to be trimmed
                return q, sz
            log.warning("int4 codes %s have the wrong shape: choosing them again", path)
        self.misses += 1
        q, sz = quant.int4_codes(w, group, dtype, hessian)
        try:
            tensor_files.write(path, {"codes": quant.pack_nibbles(q), "scale_zeros": sz})
        except Exception as e:  # a cache that cannot be written must never fail the load
            log.warning("cannot store int4 codes in %s: %s", self.root, e)
        return q, sz

    def trim(self) -> int:
        """Delete the least recently used entries until the directory fits the budget (and
        temporary files a dead writer left); returns the bytes freed. Another process's
        concurrent trim or read is harmless: a vanished file is skipped, or read as a miss."""
        entries, freed, now = [], 0, time.time()
        try:
            listing = list(self.root.iterdir())
        except OSError:
            return 0
        for path in listing:
            try:
                st = path.stat()
            except OSError:
                continue
            if path.name.startswith(".part-"):
                if now - st.st_mtime > STALE_PART_S:
                    freed += _unlink(path, st.st_size)
            elif path.suffix == ".safetensors":
                entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        if self.budget > 0:
            for _, size, path in sorted(entries):
                if total <= self.budget:
                    break
                gone = _unlink(path, size)
                freed += gone
                total -= gone
        if freed:
            mb = (freed / 1e6, total / 1e6, self.budget / 1e6)
            log.info("int4 codes: freed %.1f MB in %s (%.1f MB kept, budget %.1f MB)", mb[0], self.root, *mb[1:])
        return freed


def _unlink(path: Path, size: int) -> int:
    try:
        path.unlink()
    except OSError:  # gone already (another process trimmed it), or not ours to delete
        return 0
    return size
