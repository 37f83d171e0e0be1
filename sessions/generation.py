"""One engine request of a reply, planned, submitted and read: what a Responses turn
(`sessions.turn`) and a Chat Completions reply (`api.chat`, a stateless turn) share.

`Generations.plan` turns a rendered prompt and what the request asks of its reply (`ReplyAsk`,
in its API's field names) into a `Generation`:
- the output limit: min(context left, KV capacity left, `--max-output-tokens`) when none is
  asked; a value over the cap, or a prompt that leaves no room, is a 400 naming the field
  (`context_length_exceeded` with both numbers);
- the grammar (`GrammarCompiler.for_request`, off the event loop; its `InvalidRequest` names
  the field in Chat's shape), and the reply's readers: `ReasoningSplitter` for `<think>`
  templates, `ToolCallParser` when tools are offered;
- the sampling params, and the reply's forced first tokens (a required call's marker and name,
  `XGrammarMatcher.forced_prefix`): prefilled with the prompt, yet output of the reply (not when
  logprobs are asked for: a prefilled token has none).

`Generation.submit` adds the engine request (id = the reply's, cache salt = the tenant);
`Generation.read` feeds the reply its text (the forced text first) and yields each engine output
once fed, counting what `usage` reports; it gives back the tenant's waiting place at the first
output, and leaving it before the final output aborts the engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.loading.tokenizer import Tokenizer
from engine.request import FinishReason, RequestHandle, RequestOutput
from engine.sampling_params import SamplingParams
from engine.surface import EngineSurface
from engine.tokenizer_pool import TokenizerPool
from sessions.config import ServiceConfig
from sessions.errors import ContextLengthExceeded, InvalidParam
from sessions.models import InputTokensDetails, OutputTokensDetails, Usage
from sessions.reasoning import ReasoningSplitter, opens_in_reasoning, uses_reasoning
from sessions.render import Prompt
from sessions.requests import sampling_params
from sessions.waiting import WaitingPlace
from tools.calls import ToolCallParser
from tools.constraints import OutputFormat
from tools.formats import ToolCallFormat, needs_special_tokens
from tools.grammar import GrammarCompiler, XGrammarMatcher
from tools.schema import ToolSpec


@dataclass(frozen=True, kw_only=True)
class ReplyAsk:
    """What a request asks of its reply.

    Attributes:
        tools: the declared tools; offered to the model unless `tool_choice` is `none`.
        tool_choice: either API's shape (None: auto).
        output_format: the reply's text format (`kind` text: free).
        max_tokens: the asked output limit (None: the default, see the module docstring).
        max_tokens_param, prompt_param: the request's names for the limit and for the prompt,
            which a limit error names.
        temperature ... logprobs: `SamplingParams`' fields as asked (`logprobs`: top-n, None: off).
        priority: the engine's admission order (background jobs: 1).
    """

    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    output_format: OutputFormat = field(default_factory=OutputFormat)
    max_tokens: int | None = None
    max_tokens_param: str = "max_output_tokens"
    prompt_param: str = "input"
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    presence_penalty: float = SamplingParams.presence_penalty
    frequency_penalty: float = SamplingParams.frequency_penalty
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    priority: int = SamplingParams.priority

    @property
    def offered(self) -> list[ToolSpec]:
        return self.tools if self.tool_choice != "none" else []


class Reply(Protocol):
    """What a reply's text goes to (`sessions.output.OutputAssembler`, `api.chat_reply.ChatReply`)."""

    async def feed(self, text: str) -> None: ...


@dataclass(eq=False, kw_only=True)
class Generation:
    """One planned engine request and what reading it counted (see the module docstring)."""

    id: str
    tenant: str
    prompt: Prompt
    params: SamplingParams
    matcher: XGrammarMatcher | None
    parser: ToolCallParser | None
    splitter: ReasoningSplitter
    forced_ids: list[int] = field(default_factory=list)
    forced_text: str = ""
    waiting: WaitingPlace | None = None  # the tenant's waiting place (`sessions.waiting`), until the first output
    handle: RequestHandle | None = None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    reason: FinishReason | None = None  # None until the final output (or when left early)
    error: str | None = None

    @property
    def in_reasoning(self) -> bool:
        return self.splitter.in_reasoning

    def submit(self, engine: EngineSurface) -> RequestHandle:
        """Add the engine request (raises the engine's overload or context errors, nothing started)."""
        params = self.params
        if self.forced_ids:
            params = replace(params, max_tokens=params.max_tokens - len(self.forced_ids))
        self.handle = engine.add_request(
            self.prompt.ids + self.forced_ids,
            params,
            request_id=self.id,
            cache_salt=self.tenant,
            matcher=self.matcher,
            images=list(self.prompt.images) or None,
        )
        return self.handle

    def release(self) -> None:
        """Give back the tenant's waiting place (idempotent)."""
        if self.waiting is not None:
            self.waiting.release()

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.abort()

    async def read(self, reply: Reply) -> AsyncGenerator[RequestOutput, None]:
        """Feed `reply` the forced text, then each output's text; yields each output once fed.
        Close it (`contextlib.aclosing`) when leaving early: the engine request is aborted."""
        handle = self.handle
        assert handle is not None, "submit() first"
        self.output_ids = list(self.forced_ids)
        try:
            if self.forced_text:
                await reply.feed(self.forced_text)
            async for out in handle:
                self.release()
                if self.in_reasoning:
                    self.reasoning_tokens += len(out.token_ids)
                self.output_ids += out.token_ids
                self.cached_tokens = min(out.cached_tokens, len(self.prompt.ids))
                if out.text_delta:
                    await reply.feed(out.text_delta)
                if out.finish_reason is not None:
                    self.reason, self.error = out.finish_reason, out.error
                yield out
        finally:
            self.release()
            if self.reason is None:  # left early or cancelled: the engine must not run on
                handle.abort()

    def usage(self) -> Usage:
        n_in, n_out = len(self.prompt.ids), len(self.output_ids)
        return Usage(
            input_tokens=n_in,
            input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
            output_tokens=n_out,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.reasoning_tokens),
            total_tokens=n_in + n_out,
        )


class Generations:
    """Plans generations over one engine, tokenizer and grammar compiler (see the module docstring)."""

    def __init__(
        self,
        engine: EngineSurface,
        tokenizer: Tokenizer,
        compiler: GrammarCompiler,
        tool_format: ToolCallFormat,
        config: ServiceConfig,
        tokenizing: TokenizerPool,
    ):
        self.engine, self.tokenizer, self.compiler, self.tool_format = engine, tokenizer, compiler, tool_format
        self.config, self.tokenizing = config, tokenizing
        self.reasoning = uses_reasoning(tokenizer.chat_template)
        # a call marker that is a special token (Mistral's) must reach the call parser
        self.keep_special = needs_special_tokens(tool_format, tokenizer)

    def max_tokens(self, prompt_len: int, ask: ReplyAsk) -> int:
        """The output limit (see the module docstring)."""
        limit = min(self.engine.max_model_len, self.engine.capacity_tokens)
        cap, asked = self.config.max_output_tokens, ask.max_tokens
        if asked is not None and asked > cap:
            raise InvalidParam(ask.max_tokens_param, f"at most {cap} on this server, got {asked}")
        want = asked if asked is not None else 1
        if prompt_len + want > limit:
            raise ContextLengthExceeded(
                ask.prompt_param,
                f"the context is {prompt_len} tokens and asks for {want} more; the limit is {limit} tokens",
            )
        return asked if asked is not None else min(limit - prompt_len, cap)

    async def plan(self, ask: ReplyAsk, prompt: Prompt, *, request_id: str, tenant: str) -> Generation:
        """Every check and computation before the engine call (see the module docstring).

        Raises:
            InvalidParam (ContextLengthExceeded), or tools' InvalidRequest for the grammar.
        """
        max_tokens = self.max_tokens(len(prompt.ids), ask)
        grammar = await asyncio.to_thread(self._grammar, ask)
        offered = ask.offered
        params = sampling_params(
            {"max_tokens": ask.max_tokens_param, "logprobs": "top_logprobs"},
            max_tokens=max_tokens,
            temperature=ask.temperature,
            top_p=ask.top_p,
            presence_penalty=ask.presence_penalty,
            frequency_penalty=ask.frequency_penalty,
            seed=ask.seed,
            stop=ask.stop,
            logprobs=ask.logprobs,
            priority=ask.priority,
            skip_special_tokens=not (self.keep_special and bool(offered)),
        )
        generation = Generation(
            id=request_id,
            tenant=tenant,
            prompt=prompt,
            params=params,
            matcher=self.compiler.matcher(grammar) if grammar is not None else None,
            parser=ToolCallParser(self.tool_format, offered) if offered else None,
            splitter=ReasoningSplitter(self.reasoning, self.reasoning and opens_in_reasoning(prompt.text)),
        )
        if generation.matcher is not None and not generation.in_reasoning and params.logprobs is None:
            forced = await self.tokenizing.run(_forced, generation.matcher, self.tokenizer, params)
            generation.forced_ids, generation.forced_text = forced
        return generation

    def _grammar(self, ask: ReplyAsk) -> Any:
        if ask.output_format.kind == "text" and not ask.offered:
            return None
        return self.compiler.for_request(
            ask.output_format, ask.offered, ask.tool_choice, ask.parallel_tool_calls, self.tool_format
        )


def _forced(matcher: XGrammarMatcher, tokenizer: Tokenizer, params: SamplingParams) -> tuple[list[int], str]:
    """The reply's forced first tokens (`XGrammarMatcher.forced_prefix`) and their text as the
    engine would stream it."""
    ids = matcher.forced_prefix(tokenizer, params.max_tokens - 1)
    return ids, tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens) if ids else ""
