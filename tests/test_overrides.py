"""`--hf-overrides` merged into a checkpoint's config, and `--chat-template`'s choices."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest

from engine.loading.overrides import BadOverride, apply_overrides, fingerprint, parse_overrides
from engine.loading.tokenizer import CHATML, NoChatTemplate, Tokenizer
from engine.model.config import ModelConfig
from sessions.config import generation_defaults
from sessions.render import render_text
from tests.structured_demo import compiler
from tools.prompt import render_prompt

BASE = ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16, 1e-5, 8192)
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 32768}  # fmt: skip


def test_yarn_override_merges_into_the_config() -> None:
    out = apply_overrides(BASE, YARN)
    assert out.rope.type == "yarn" and out.rope.factor == 4.0 and out.rope.original_max_position_embeddings == 8192
    assert out.rope.theta == BASE.rope.theta and out.max_position_embeddings == 32768
    assert BASE.max_position_embeddings == 8192  # the original is untouched
    assert apply_overrides(BASE, {}) == BASE
    assert fingerprint("abc", {}) == "abc" and fingerprint("abc", YARN) != fingerprint("abc", {"rope_theta": 1e6})


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"hidden_size": 8}, "hidden_size"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"rope_scaling": {"rope_type": "warp"}}, "rope_scaling"),
        ({"rope_scaling": 4}, "rope_scaling"),
        ({"max_position_embeddings": -1}, "max_position_embeddings"),
        ({"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_a_bad_override_names_its_key(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(BadOverride) as e:
        apply_overrides(BASE, overrides)
    assert e.value.key == key and key in str(e.value)


def test_override_json_must_be_an_object() -> None:
    assert parse_overrides(None) == {} and parse_overrides('{"rope_theta": 5}') == {"rope_theta": 5}
    for bad in ("[1]", "{nope"):
        with pytest.raises(BadOverride):
            parse_overrides(bad)


def _demo_tokenizer(demo_gguf: Path) -> Tokenizer:
    demo = compiler(str(demo_gguf)).tokenizer
    return Tokenizer(copy.deepcopy(demo.hf), demo.eos_token_ids)


def test_chat_template_choices(demo_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    base = _demo_tokenizer(demo_gguf)
    base.hf.chat_template = None  # a base model
    with pytest.raises(NoChatTemplate):
        render_text(base, hi, [])
    assert render_prompt(base, hi, [])  # the doctor's tool-call check renders a base model with ChatML
    with caplog.at_level(logging.WARNING, logger="longctx.loader"):
        base.use_chat_template(None, "base-model")
    assert "no chat template" in caplog.text and base.chat_template == CHATML
    assert render_text(base, hi, []) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    own = tmp_path / "t.jinja"
    own.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    custom = _demo_tokenizer(demo_gguf)
    custom.use_chat_template(str(own))
    assert render_text(custom, hi, [], generation_prompt=False) == "[user] Hi\n"
    off = _demo_tokenizer(demo_gguf)
    off.use_chat_template("none", "demo")
    with pytest.raises(NoChatTemplate) as e:
        render_text(off, hi, [])
    assert e.value.param == "model" and "'demo'" in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        _demo_tokenizer(demo_gguf).use_chat_template(str(tmp_path / "missing.jinja"))


def test_generation_defaults_name_a_bad_key() -> None:
    assert generation_defaults(None) == {} and generation_defaults('{"temperature": 0}') == {"temperature": 0.0}
    for bad, word in (('{"top_k": 5}', "top_k"), ('{"temperature": "hot"}', "temperature"), ("[0]", "object")):
        with pytest.raises(ValueError, match=word):
            generation_defaults(bad)
