"""What the stages after loading share: the loaded model, the options, the fixed prompts and
our model's captured activations on them (computed once, used by reference, baseline and
activations)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from api.doctor.capture import PROMPTS, Capture, capture_ours
from api.doctor.options import DoctorOptions
from engine.loading.loader import LoadedModel


@dataclass
class DoctorContext:
    loaded: LoadedModel
    options: DoctorOptions
    reference_model: Any = None  # a transformers model given by the caller (else loaded when needed)
    served: LoadedModel | None = None  # the serving stage's model given by the caller (else loaded)
    _prompts: list[list[int]] | None = None
    _ours: list[Capture] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.loaded.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.loaded.dtype).replace("torch.", "")

    @property
    def prompts(self) -> list[list[int]]:
        """The fixed prompts' token ids: a baseline's own ids when comparing against one (so that
        a tokenizer change cannot hide or fake a difference), else the tokenized `PROMPTS`."""
        if self._prompts is None:
            base = self.options.baseline
            if base is not None and base.exists():
                self._prompts = [list(p) for p in json.loads(base.read_text())["prompts"]]
            else:
                self._prompts = [self.loaded.tokenizer.encode(p) for p in PROMPTS]
        return self._prompts

    @property
    def ours(self) -> list[Capture]:
        if self._ours is None:
            self._ours = capture_ours(self.loaded.model, self.prompts)
        return self._ours
