"""The wheel carries what the installed code reads: built with `pip wheel`, installed (no
dependencies, no editable install on the path) into a venv that sees the test venv's packages, it runs
`longctx generate` on a tiny model with the C++ kernels built from the installed sources."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tests.server import ROOT
from tests.tiny_models import build_tiny

pytestmark = pytest.mark.slow


def test_wheel_installs_and_runs_with_its_kernels(tmp_path: Path, demo_float32: object) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, timeout=600)  # fmt: skip
    (wheel,) = wheels.glob("longctx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.relative_to(ROOT).as_posix() for d in ("engine", "kvstore", "sessions", "tools", "api")
               for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]  # fmt: skip
    assert sources and set(sources) <= names, sorted(set(sources) - names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # The test venv's packages (torch, ...) after the new venv's own, as a plain path: its .pth
    # files, the editable install of this checkout among them, are not processed.
    own = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    Path(own, "test-venv-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    model = tmp_path / "model"
    build_tiny(LlamaConfig, LlamaForCausalLM, model, vocab_size=49152)
    demo_float32.tokenizer.hf.save_pretrained(model)  # type: ignore[attr-defined]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "LONGCTX_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    where = subprocess.run([str(py), "-c", "import engine, api; print(engine.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, check=True)  # fmt: skip
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel's code, not the checkout's
    out = subprocess.run([str(venv / "bin" / "longctx"), "generate", "--model", str(model), "--prompt", "Hello",
                          "--max-tokens", "4", "--no-compile"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "built the attention kernels" in out.stderr, out.stderr[-3000:]
    assert "not built" not in out.stderr, out.stderr[-3000:]
    built = list((tmp_path / "home" / "kernels").glob("paged_decode-*.so"))
    assert len(built) == 1
