"""The model's tokenizer and chat template, through transformers.

Which chat template is used (`--chat-template FILE|chatml|none`, vLLM's flag; `use_chat_template`):
the checkpoint's own by default, and for a checkpoint without one (a base model) the built-in
ChatML, with a WARNING at start, so that any checkpoint can answer chat and Responses requests.
`chatml` always uses the built-in one, a file path the Jinja template in the file, and `none`
no template: rendering a conversation then raises `NoChatTemplate`, a 400 naming the model.
The choice is applied after loading and is never written into a GGUF's conversion cache.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.loading.model_source import ModelPath

# Saved classes that are the `tokenizers` library's tokenizer and nothing more: loaded through
# `PreTrainedTokenizerFast` directly, which skips `AutoTokenizer`'s import of every model
# family's module (most of a second).
PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# ChatML, as Qwen's and SmolLM's templates write it, without their default system prompt.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_END = "<|im_end|>"
log = logging.getLogger("longctx.loader")


class NoChatTemplate(ValueError):
    """A conversation was to be rendered for a model served with `--chat-template none`."""

    param = "model"

    def __init__(self, model: str):
        super().__init__(
            f"the model {model!r} is served without a chat template (--chat-template none): it cannot answer chat "
            "or Responses requests; serve it with --chat-template chatml or FILE"
        )


class Tokenizer:
    """Wraps a transformers tokenizer: encode, decode, chat templates, end-of-sequence ids."""

    def __init__(self, hf: Any, eos_token_ids: tuple[int, ...] = ()):
        self.hf = hf
        ids = set(eos_token_ids)
        if hf.eos_token_id is not None:
            ids.add(int(hf.eos_token_id))
        self.eos_token_ids = tuple(sorted(ids))
        self.name = ""  # the model's name, for errors
        self.chat_disabled = False  # `--chat-template none`

    def use_chat_template(self, flag: str | None, name: str = "") -> None:
        """Apply `--chat-template` (see the module docstring): None keeps the checkpoint's own,
        or the built-in ChatML when it has none (a WARNING).

        Raises:
            ValueError: a template file that cannot be read.
        """
        self.name = name or self.name
        if flag == "none":
            self.chat_disabled = True
            return
        if flag is None and self.chat_template:
            return
        if flag is None or flag == "chatml":
            if flag is None:
                log.warning("the model %s has no chat template: using the built-in ChatML (--chat-template)", name)
            self.hf.chat_template = CHATML
            end = self.hf.convert_tokens_to_ids(CHATML_END) if CHATML_END in self.hf.get_vocab() else None
            if isinstance(end, int):  # a ChatML turn ends generation where the vocabulary has its marker
                self.eos_token_ids = tuple(sorted({*self.eos_token_ids, end}))
            return
        try:
            self.hf.chat_template = Path(flag).expanduser().read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {flag}: cannot read the file ({e.strerror or e})") from None

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
        if self.chat_disabled:
            return ""
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one, or all of them
            template = template.get("default") or "\n".join(str(t) for t in template.values())
        return str(template or "")

    @property
    def renders_tools(self) -> bool:
        """Whether the template uses the `tools` it is given; when not, `tools.formats` renders them."""
        return "tools" in self.chat_template

    def check_chat(self) -> None:
        """Raise NoChatTemplate when conversations cannot be rendered (`--chat-template none`)."""
        if self.chat_disabled or not self.chat_template:
            raise NoChatTemplate(self.name)

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
        fallback: bool = False,
    ) -> list[int]:
        """Rendered and tokenized; `fallback`: without a template of its own, the built-in ChatML
        (what `--chat-template` would give the model) instead of NoChatTemplate."""
        template = None
        if fallback and not self.chat_disabled and not self.chat_template:
            template = CHATML
        else:
            self.check_chat()
        out = self.hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            chat_template=template,
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]
