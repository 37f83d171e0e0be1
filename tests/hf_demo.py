"""transformers' own load of the demo GGUF (its dequantization and its mapping to Llama), the
reference several test modules compare against, kept as a checkpoint so later loads read it back
instead of parsing the GGUF again (22-28 s on one AVX2 core, about 17 s elsewhere; reading back:
about 0.3 s).

The checkpoint lives under `$LONGCTX_HOME/test-references/`, named by the GGUF's size and mtime
and the transformers and torch versions: it holds exactly what transformers made of the file
(that model's float32 tensors and its config, without the GGUF's `quantization_config` note), so
the reference stays independent of our own conversion (`engine/loading/gguf_cache.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from api.doctor.reference_stage import load_transformers
from engine.loading.model_source import longctx_home, resolve_model


def _dir(gguf: Path) -> Path:
    import transformers

    st = gguf.stat()
    versions = f"transformers-{transformers.__version__}-torch-{torch.__version__}"
    name = f"{gguf.name}-{st.st_size}-{st.st_mtime_ns}-{versions}"
    return longctx_home() / "test-references" / name


def transformers_demo(gguf: Path) -> Any:
    """The demo model as transformers loads the GGUF itself (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    kept = _dir(gguf)
    if (kept / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(str(kept), dtype=torch.float32).eval()
    model = load_transformers(resolve_model(str(gguf)), torch.float32)  # the doctor's own reference load
    kept.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".part-", dir=kept.parent))
    try:
        # transformers will not `save_pretrained` a model it loaded from a GGUF: its weights and
        # config are written as a plain checkpoint (tied tensors once each).
        from safetensors.torch import save_model

        (tmp / "model").mkdir()
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "model" / "config.json").write_text(json.dumps(config))
        save_model(model, str(tmp / "model" / "model.safetensors"))
        with contextlib.suppress(OSError):  # else another worker kept it meanwhile
            os.replace(tmp / "model", kept)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model
