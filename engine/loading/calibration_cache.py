"""int4 calibration statistics kept on disk, so a later load of the same model skips the pass.

Calibrating (`engine/loading/calibrate.py`) loads the whole unquantized model and runs it over
~1.7k tokens: on the demo model 11 s in float32 and 45 s in bf16 on a 2-core AVX2 CPU at one
thread, minutes on a large model, at every start of `--quantization int4` at group 64 or 128.
Its result depends only on the weights, the dtype it ran in, the group, the text and the code
that computed it, so it is kept under

    $LONGCTX_HOME/calibration/<key>.safetensors   the blocks of `Calibration.hessians`, by weight
                                                   name; `tokens` and `tag` in its metadata

with the key a hash of: each weight file's path, size and mtime (as `gguf_cache` names a GGUF's
conversions: a replaced file gets a new key), the `--hf-overrides`, the dtype, the group, the
calibration text and its token ids (the tokenizer's reading of it), and the source of the
calibration pass and of what it runs (`engine/loading/calibrate.py`, `engine/model/`,
`engine/attention/` with its C++ kernels), with torch's version. A file is written under a
temporary name and renamed (two processes calibrating at once both write; one rename wins); one
that cannot be written, or read back, is logged and the load goes on (calibrating again).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import xxhash

from engine.loading import tensor_files
from engine.loading.calibrate import CHUNK_TOKENS, TEXT_FILE, Calibration
from engine.loading.model_source import ModelPath, longctx_home

log = logging.getLogger("longctx.calibration_cache")

_ENGINE = Path(__file__).parents[1]
_CODE = (
    Path(__file__).with_name("calibrate.py"),
    *sorted((_ENGINE / "model").glob("*.py")),
    *sorted(p for p in (_ENGINE / "attention").iterdir() if p.suffix in (".py", ".cpp", ".h")),
)


def _weight_files(source: ModelPath) -> list[Path]:
    if source.kind == "gguf":
        return [source.path]
    return sorted(source.path.glob("*.safetensors"))


def cache_key(
    source: ModelPath, dtype: torch.dtype, group_size: int, ids: list[int], overrides: dict[str, Any] | None
) -> str:
    """The key of one calibration: what its statistics depend on (module docstring)."""
    h = xxhash.xxh3_128()

    def part(value: str | bytes) -> None:
        h.update(value.encode() if isinstance(value, str) else value)
        h.update(b"\0")

    for f in _weight_files(source):
        st = f.stat()
        part(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    part(json.dumps(overrides or {}, sort_keys=True, default=str))
    part(f"{dtype}:{group_size}:{CHUNK_TOKENS}:{torch.__version__}")
    part(TEXT_FILE.read_bytes())
    part(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    for code in _CODE:
        part(code.read_bytes())
    return h.hexdigest()


class CalibrationCache:
    """The calibrations under `root` (default `$LONGCTX_HOME/calibration`)."""

    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else longctx_home() / "calibration"

    def path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def get(self, key: str) -> Calibration | None:
        """The calibration stored under `key`, or None (absent, or unreadable: logged)."""
        path = self.path(key)
        try:
            found = tensor_files.read(path)
            if found is None:
                return None
            hessians, meta = found
            return Calibration(hessians=hessians, tokens=int(meta["tokens"]), tag=meta["tag"])
        except Exception as e:  # a damaged file costs a calibration, never the load
            log.warning("cannot read the int4 calibration %s (%s): calibrating again", path, e)
            return None

    def put(self, key: str, calibration: Calibration) -> None:
        """Store `calibration` under `key` (atomically; a failure is logged, not raised)."""
        try:
            meta = {"tokens": str(calibration.tokens), "tag": calibration.tag}
            tensor_files.write(self.path(key), calibration.hessians, meta)
        except Exception as e:  # a cache that cannot be written must never fail the load
            log.warning("cannot store the int4 calibration in %s: %s", self.root, e)
