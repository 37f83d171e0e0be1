"""xgrammar behind the engine's grammar hook (`engine.sampling.grammar`).

Two levels, as in vLLM's structured-output backends: a `GrammarCompiler` built once per tokenizer
(compiling takes ~0.1 s a schema, so compiled grammars are cached by their canonical JSON), and per
request an `XGrammarMatcher` (accept, rollback, terminated). `XGrammarHook` fills the masks of a
whole batch in one `BatchGrammarMatcher` call, in the engine's bitmask format (`[B, ceil(V/32)]`
int32, bit set = allowed, V = the model's vocab size, which may exceed the tokenizer's).

Matchers are created on the caller's thread and then used only by the engine thread. With the
engine in its own process (`engine/process/main.py`) a matcher crosses as its grammar's cache key
and the tokens it has accepted (`XGrammarMatcher.key`, `.accepted`): the engine process compiles
the key again (`GrammarCompiler.from_key`, cached there too) and replays the tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr
from xgrammar import structural_tag as st

from engine.loading.tokenizer import Tokenizer
from engine.sampling.grammar import GrammarHook, Matcher
from tools.constraints import OutputFormat, parse_output_format, parse_tool_choice
from tools.formats import HERMES, ToolCallFormat, structural_tag
from tools.schema import InvalidOutputFormat, InvalidSchema, ToolSpec, check_json_schema, clean_compiler_message

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

    def _cached(self, key: str, compile_fn: Any, where: str, param: str | None = None) -> xgr.CompiledGrammar:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = compile_fn()
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError from C++
            raise InvalidSchema(where, "$", clean_compiler_message(str(e)), param) from None
        compiled._longctx_key = key  # type: ignore[attr-defined]  # how it crosses to the engine process
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def json_schema(self, schema: Any, where: str = "response_format", param: str | None = None) -> xgr.CompiledGrammar:
        """A strict JSON-schema grammar (no properties beyond the schema's unless it allows them).

        Args:
            where: what the schema belongs to, for errors; `param`: its path in the request.

        Raises:
            InvalidSchema: invalid JSON Schema, or a feature xgrammar cannot express.
        """
        schema = check_json_schema(schema, where, param)
        text = json.dumps(schema)  # not sorted: property order is the order the grammar generates
        return self._cached(f"schema:{text}", lambda: self._compile_schema(text, strict=True), where, param)

    def _compile_schema(self, text: str, strict: bool) -> xgr.CompiledGrammar:
        # Compact JSON (", " and ": " only): free whitespace lets a small model pad forever.
        return self._xgr.compile_json_schema(text, any_whitespace=False, strict_mode=strict)

    def json_object(self) -> xgr.CompiledGrammar:
        """Any JSON object (`response_format: {"type": "json_object"}`)."""
        schema = json.dumps({"type": "object"})
        return self._cached("object", lambda: self._compile_schema(schema, strict=False), "json_object")

    def output_format(self, reply: OutputFormat) -> xgr.CompiledGrammar | None:
        """The grammar of a reply in `reply`'s format alone; None for free text."""
        if reply.kind == "json_schema":
            return self.json_schema(reply.schema, _where(reply), reply.schema_param)
        return self.json_object() if reply.kind == "json_object" else None

    def _text_format(self, reply: OutputFormat) -> st.GrammarFormat:
        """`reply`'s JSON as one part of a structural tag: the same compact grammar as `output_format`'s."""
        if reply.kind == "json_schema":
            schema, strict = check_json_schema(reply.schema, _where(reply), reply.schema_param), True
        else:
            schema, strict = {"type": "object"}, False
        try:
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidSchema(_where(reply), "$", clean_compiler_message(str(e)), reply.schema_param) from None
        return st.GrammarFormat(grammar=str(grammar))

    def check_tools(self, tools: list[ToolSpec]) -> None:
        """Compiles each tool's parameters alone, so that a schema the grammar cannot express is
        reported against its tool, not against the whole tool list.

        Raises:
            InvalidSchema: naming the tool and the compiler's reason (`param`: where it was declared).
        """
        for t in tools:
            self.json_schema(t.parameters, where=f"tool {t.name!r} parameters", param=t.param or None)

    def tool_calls(
        self,
        fmt: ToolCallFormat,
        tools: list[ToolSpec],
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
        reply: OutputFormat | None = None,
    ) -> xgr.CompiledGrammar:
        """The grammar of a reply that may (or must) call the declared tools, in `fmt`'s syntax.

        `reply`: a JSON format for the reply when it calls no tool (see `formats.structural_tag`).
        """
        self.check_tools(tools)
        text = self._text_format(reply) if reply is not None and reply.kind != "text" else None
        tag = structural_tag(fmt, tools, tool_choice, parallel_tool_calls, text)
        key = tag.model_dump_json()
        return self._cached(f"tag:{key}", lambda: self._xgr.compile_structural_tag(key), "tools", "tools")

    def for_request(
        self,
        response_format: dict[str, Any] | OutputFormat | None = None,
        tools: list[ToolSpec] | None = None,
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
        fmt: ToolCallFormat | None = None,
    ) -> xgr.CompiledGrammar | None:
        """The grammar a Chat Completions or Responses request asks for, or None when its reply is free.

        The reply is text in the format, or calls of the declared tools as `tool_choice` allows. A
        JSON format with tools: under `auto` the reply is either JSON in that format or calls alone,
        under `required` or a named function calls alone, under `none` the format alone.

        Args:
            response_format: Chat's `response_format`, or an `OutputFormat` (the Responses API's
                `text.format` goes through `parse_output_format(format, "text.format")`, so that
                errors name that field).
            tools: `parse_tools`' result.
            tool_choice: either API's shape, or a `ToolChoice`; None means auto.
            fmt: the call syntax (Hermes when not given).

        Raises:
            InvalidRequest: `InvalidOutputFormat`, `InvalidToolChoice` or `InvalidSchema`, whose
                `param` names the request field.
        """
        reply = parse_output_format(response_format)
        tools, fmt = tools or [], fmt or HERMES
        choice = parse_tool_choice(tool_choice, tools)
        if not tools or (choice.mode == "none" and reply.kind != "text"):
            return self.output_format(reply)
        if reply.kind == "text" or choice.mode != "auto":
            return self.tool_calls(fmt, tools, choice, parallel_tool_calls)
        if fmt.start_in_body:
            raise InvalidOutputFormat(
                reply.param,
                f"a JSON reply format cannot be combined with tools under tool_choice auto in the {fmt.name} "
                "call format: its calls are bare JSON objects, so a reply could not be told from a call",
            )
        return self.tool_calls(fmt, tools, choice, parallel_tool_calls, reply)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        """A fresh matcher for one request."""
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        return XGrammarMatcher(matcher, getattr(compiled, "_longctx_key", None))

    def from_key(self, key: str) -> xgr.CompiledGrammar:
        """The grammar a cache key names (`XGrammarMatcher.key`), compiled here (or cached)."""
        if key == "object":
            return self.json_object()
        if key.startswith("schema:"):
            text = key.removeprefix("schema:")
            return self._cached(key, lambda: self._compile_schema(text, strict=True), "response_format")
        if key.startswith("tag:"):
            text = key.removeprefix("tag:")
            return self._cached(key, lambda: self._xgr.compile_structural_tag(text), "tools", "tools")
        raise ValueError(f"unknown grammar key {key[:40]!r}")


def engine_grammar(tokenizer: Tokenizer, vocab_size: int) -> tuple[XGrammarHook, Any]:
    """The engine process's grammar side (`engine.process.main.LoadSpec.grammar`): the batch hook,
    and `matcher(key, accepted)` rebuilding a caller's matcher at the same position."""
    compiler = GrammarCompiler(tokenizer, vocab_size)

    def matcher(key: str, accepted: list[int]) -> XGrammarMatcher:
        m = compiler.matcher(compiler.from_key(key))
        for token in accepted:
            if not m.xgr.accept_token(token):
                raise ValueError(f"token {token} of the forced prefix is not allowed by the output grammar")
        m.accepted = list(accepted)
        return m

    return XGrammarHook(), matcher


class XGrammarMatcher(Matcher):
    """One request's position in its grammar (the engine's `Matcher`).

    A dead end (no token allowed, which a sound grammar never reaches but a schema compiled with
    warnings might) leaves its mask row fully open and rejects the next token, so the engine ends
    the request with FinishReason.ERROR instead of sampling from an empty distribution; `error`
    then says why.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, key: str | None = None):
        self.xgr = matcher
        self.error: str | None = None
        self.key = key  # the compiler's cache key of its grammar (None: not from a GrammarCompiler)
        self.accepted: list[int] = []  # by `forced_prefix`, before the request is sent

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

    def forced_prefix(self, tokenizer: Tokenizer, limit: int) -> list[int]:
        """The tokens every reply must start with from here (xgrammar's jump-forward string, such
        as a required call's marker and name), accepted into this matcher, so that a caller can
        prefill them with the prompt instead of decoding them one step each. The string's last
        token is left to the model (how it tokenizes may depend on what follows); at most `limit`
        tokens; [] when nothing is forced or the tokens do not fit the grammar.
        """
        text = self.xgr.find_jump_forward_string() if limit > 0 else ""
        if not text:
            return []
        ids = list(tokenizer.hf.encode(text, add_special_tokens=False))[:-1][:limit]
        if not ids or not text.startswith(tokenizer.decode(ids, skip_special_tokens=False)):
            return []
        for n, token in enumerate(ids):
            if not self.xgr.accept_token(token):
                self.xgr.rollback(n)
                return []
        self.accepted += ids
        return ids


def _where(reply: OutputFormat) -> str:
    where = reply.schema_param or reply.param
    return f"{where} ({reply.name!r})" if reply.name else where


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
