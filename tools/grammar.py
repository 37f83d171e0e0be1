"""xgrammar behind the engine's grammar hook (`engine.grammar`).

Two levels, as in vLLM's structured-output backends: a `GrammarCompiler` built once per tokenizer
(compiling takes ~0.1 s a schema, so compiled grammars are cached by their canonical JSON), and per
request an `XGrammarMatcher` (accept, rollback, terminated). `XGrammarHook` fills the masks of a
whole batch in one `BatchGrammarMatcher` call, in the engine's bitmask format (`[B, ceil(V/32)]`
int32, bit set = allowed, V = the model's vocab size, which may exceed the tokenizer's).

Matchers are created on the caller's thread and then used only by the engine thread.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr

from engine.grammar import GrammarHook, Matcher
from engine.loading.tokenizer import Tokenizer
from tools.formats import HERMES, ToolCallFormat, structural_tag
from tools.schema import InvalidSchema, ToolSpec, check_json_schema, clean_compiler_message

DEAD_END = "the output grammar allows no next token (dead end)"
ENDED = "the output grammar has already ended"


class GrammarCompiler:
    """Compiles output formats for one tokenizer; thread-safe, with an LRU cache of compiled grammars.

    Args:
        tokenizer: the model's tokenizer (its eos ids are the grammar's stop tokens).
        vocab_size: the model's vocab size = logits width; padding ids beyond the tokenizer are never allowed.
        max_threads: xgrammar's compile threads.
        cache_size: compiled grammars kept.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_threads: int = 2, cache_size: int = 256):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(tokenizer.eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._xgr = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _cached(self, key: str, compile_fn: Any, where: str) -> xgr.CompiledGrammar:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = compile_fn()
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError from C++
            raise InvalidSchema(where, "$", clean_compiler_message(str(e))) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def json_schema(self, schema: Any, where: str = "response_format") -> xgr.CompiledGrammar:
        """A strict JSON-schema grammar (no properties beyond the schema's unless it allows them).

        Raises:
            InvalidSchema: invalid JSON Schema, or a feature xgrammar cannot express.
        """
        schema = check_json_schema(schema, where)
        text = json.dumps(schema)  # not sorted: property order is the order the grammar generates
        return self._cached(f"schema:{text}", lambda: self._compile_schema(text, strict=True), where)

    def _compile_schema(self, text: str, strict: bool) -> xgr.CompiledGrammar:
        # Compact JSON (", " and ": " only): free whitespace lets a small model pad forever.
        return self._xgr.compile_json_schema(text, any_whitespace=False, strict_mode=strict)

    def json_object(self) -> xgr.CompiledGrammar:
        """Any JSON object (`response_format: {"type": "json_object"}`)."""
        schema = json.dumps({"type": "object"})
        return self._cached("object", lambda: self._compile_schema(schema, strict=False), "json_object")

    def check_tools(self, tools: list[ToolSpec]) -> None:
        """Compiles each tool's parameters alone, so that a schema the grammar cannot express is
        reported against its tool, not against the whole tool list.

        Raises:
            InvalidSchema: naming the tool and the compiler's reason.
        """
        for t in tools:
            self.json_schema(t.parameters, where=f"tool {t.name!r} parameters")

    def tool_calls(
        self, fmt: ToolCallFormat, tools: list[ToolSpec], tool_choice: Any = "auto", parallel_tool_calls: bool = True
    ) -> xgr.CompiledGrammar:
        """The grammar of a reply that may (or must) call the declared tools, in `fmt`'s syntax."""
        self.check_tools(tools)
        tag = structural_tag(fmt, tools, tool_choice, parallel_tool_calls)
        text = tag.model_dump_json()
        return self._cached(f"tag:{text}", lambda: self._xgr.compile_structural_tag(text), "tools")

    def for_request(
        self,
        response_format: dict[str, Any] | None = None,
        tools: list[ToolSpec] | None = None,
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
        fmt: ToolCallFormat | None = None,
    ) -> xgr.CompiledGrammar | None:
        """The grammar an OpenAI chat request asks for, or None when its output is free.

        `response_format` `json_schema` (strict) or `json_object` wins over tools; otherwise declared
        tools constrain the calls (`fmt` defaults to Hermes).

        Raises:
            InvalidSchema, ValueError: a bad schema or `response_format` / `tool_choice`.
        """
        kind = (response_format or {}).get("type", "text")
        if kind == "json_schema":
            spec = response_format["json_schema"] if response_format else {}
            return self.json_schema(spec.get("schema", {}), where=f"response_format {spec.get('name', '')!r}")
        if kind == "json_object":
            return self.json_object()
        if kind != "text":
            raise ValueError(f"response_format: unknown type {kind!r}; expected text, json_object or json_schema")
        if not tools:
            return None
        return self.tool_calls(fmt or HERMES, tools, tool_choice, parallel_tool_calls)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        """A fresh matcher for one request."""
        return XGrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids))


class XGrammarMatcher(Matcher):
    """One request's position in its grammar (the engine's `Matcher`).

    A dead end (no token allowed, which a sound grammar never reaches but a schema compiled with
    warnings might) leaves its mask row fully open and rejects the next token, so the engine ends
    the request with FinishReason.ERROR instead of sampling from an empty distribution; `error`
    then says why.
    """

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.xgr = matcher
        self.error: str | None = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.xgr.fill_next_token_bitmask(bitmask, row)
        check_dead_ends([self], bitmask, [row])

    def accept_token(self, token_id: int) -> bool:
        if self.error is not None:
            return False
        ok = bool(self.xgr.accept_token(token_id))
        if not ok:
            self.error = f"token {token_id} is not allowed by the output grammar"
        return ok

    def accept_string(self, text: str) -> bool:
        """Advances over text (tests script matchers with strings)."""
        return bool(self.xgr.accept_string(text))

    def rollback(self, num_tokens: int) -> None:
        self.xgr.rollback(num_tokens)
        self.error = None

    def is_terminated(self) -> bool:
        return bool(self.xgr.is_terminated())


def check_dead_ends(matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Marks matchers whose row allows nothing as dead, and opens their rows (see `XGrammarMatcher`)."""
    idx = torch.tensor(rows)
    dead = (bitmask[idx] == 0).all(dim=1)  # [n]
    if bool(dead.any()):
        for i in dead.nonzero().flatten().tolist():
            matchers[i].error = DEAD_END
            bitmask[rows[i]] = -1


class XGrammarHook(GrammarHook):
    """Fills every xgrammar row of the batch in one call (xgrammar threads over rows); other
    matchers, if any, fill their own rows."""

    def __init__(self, max_threads: int = 2):
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def fill(self, matchers: list[Matcher | None], bitmask: torch.Tensor) -> None:
        ours: list[XGrammarMatcher] = []
        rows: list[int] = []
        for row, m in enumerate(matchers):
            if isinstance(m, XGrammarMatcher) and m.is_terminated():  # xgrammar would raise; the engine stops these
                m.error = ENDED
                bitmask[row] = -1
            elif isinstance(m, XGrammarMatcher):
                ours.append(m)
                rows.append(row)
            elif m is not None:
                m.fill_bitmask(bitmask, row)
        if ours:
            self._batch.batch_fill_next_token_bitmask([m.xgr for m in ours], bitmask, indices=rows)
            check_dead_ends(ours, bitmask, rows)
