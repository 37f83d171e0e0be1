"""The model's tokenizer and chat template, through transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.loading.model_source import ModelPath

# Saved classes that are the `tokenizers` library's tokenizer and nothing more: loaded through
# `PreTrainedTokenizerFast` directly, which skips `AutoTokenizer`'s import of every model
# family's module (most of a second).
PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class Tokenizer:
    """Wraps a transformers tokenizer: encode, decode, chat templates, end-of-sequence ids."""

    def __init__(self, hf: Any, eos_token_ids: tuple[int, ...] = ()):
        self.hf = hf
        ids = set(eos_token_ids)
        if hf.eos_token_id is not None:
            ids.add(int(hf.eos_token_id))
        self.eos_token_ids = tuple(sorted(ids))

    @classmethod
    def load(cls, source: ModelPath, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        if source.kind == "gguf":
            hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        else:
            hf = AutoTokenizer.from_pretrained(str(source.path))
        return cls(hf, eos_token_ids)

    @classmethod
    def from_saved(cls, directory: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """A tokenizer written by `save_pretrained` (the GGUF conversion cache)."""
        try:
            saved_class = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
        except (OSError, ValueError, AttributeError):
            saved_class = None
        if saved_class in PLAIN_FAST_CLASSES and (directory / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast

            return cls(PreTrainedTokenizerFast.from_pretrained(str(directory)), eos_token_ids)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(directory)), eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def chat_template(self) -> str:
        """The chat template's source ("" when there is none); tool-call format detection reads it."""
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one, or all of them
            template = template.get("default") or "\n".join(str(t) for t in template.values())
        return str(template or "")

    @property
    def renders_tools(self) -> bool:
        """Whether the template uses the `tools` it is given; when not, `tools.formats` renders them."""
        return "tools" in self.chat_template

    def encode(self, text: str) -> list[int]:
        """Raw text to ids, with the special tokens the tokenizer adds (e.g. BOS)."""
        return list(self.hf.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        out = self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]
