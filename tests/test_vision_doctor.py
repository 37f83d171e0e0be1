"""The doctor's vision stage on a tiny Idefics3 checkpoint: it passes as loaded, and names the
first diverging stage when the image path is damaged in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from api.doctor import DoctorOptions
from api.doctor.run import run_stages
from engine.loading.loader import load
from tests.vision_models import build_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("idefics3")
    return path, build_checkpoint("idefics3", path)


def test_vision_stage_passes_and_compares_every_stage(checkpoint: tuple[Path, object]) -> None:
    path, ref = checkpoint
    loaded = load(str(path), dtype="float32", progress=False)
    report = run_stages(loaded, DoctorOptions(stages=("vision",)), reference_model=ref)
    st = report.stage("vision")
    assert st.status == "pass", st.reasons
    names = [r[0] for r in st.rows]
    assert names[:2] == ["image 0 tower", "image 0 connector"] and names[-2:] == ["merged input embeddings", "logits"]
    assert set(st.data["greedy"]) == {"image then text", "text then image", "two images"}


@pytest.mark.parametrize(("damage", "where"), [("tower", "image 0 tower"), ("connector", "image 0 connector")])
def test_vision_stage_names_the_first_diverging_stage(checkpoint: tuple[Path, object], damage: str, where: str) -> None:
    path, ref = checkpoint
    loaded = load(str(path), dtype="float32", progress=False)
    vision: Any = loaded.model.vision
    assert vision is not None
    with torch.no_grad():
        if damage == "tower":  # a transposed patch embedding (a loader that mixed up a layout)
            w = vision.tower.embeddings.patch_embedding.weight
            w.copy_(w.transpose(-1, -2).clone())
        else:
            w = vision.connector.modality_projection.proj.weight
            w.copy_(w.flip(0).clone())
    st = run_stages(loaded, DoctorOptions(stages=("vision",)), reference_model=ref).stage("vision")
    assert st.status == "fail"
    assert st.first("fail") is not None and st.first("fail").startswith(f"first diverging stage: {where}")  # type: ignore[union-attr]
