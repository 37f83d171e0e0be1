"""`longctx generate` with tools or a JSON schema: the prompt, the grammar, and the parsed calls.

Text goes to stdout as it streams; each finished tool call is printed as one JSON line
`{"id": ..., "name": ..., "arguments": ...}` (with `"error"` when its arguments are invalid).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.loading.tokenizer import Tokenizer
from engine.sampling.grammar import Matcher


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", type=Path, default=None, help="JSON file with a list of OpenAI function tools")
    p.add_argument("--tool-choice", default="auto", help="auto, none, required, or a function name")
    p.add_argument("--no-parallel-tool-calls", action="store_true", help="at most one call per reply")
    p.add_argument(
        "--tool-call-format", default="auto", help="auto (from the chat template), hermes, llama3 or mistral"
    )
    p.add_argument("--json-schema", type=Path, default=None, help="constrain the output to this JSON schema")


def _read_json(path: Path, flag: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path}: {e}") from e


def check_files(args: argparse.Namespace) -> None:
    """Read `--json-schema` and `--tools` and validate the tools' definitions before any model
    loads: a wrong file is a start-up error naming it at once. Whether the grammar engine can
    express them is checked later, with the tokenizer (`StructuredRun.from_args`).

    Raises:
        ValueError: naming the flag and the file, or the tool and field at fault.
    """
    from tools.schema import parse_tools

    if args.json_schema is not None:
        _read_json(args.json_schema, "--json-schema")
    if args.tools is not None:
        parse_tools(_read_json(args.tools, "--tools"))


@dataclass
class StructuredRun:
    prompt_ids: list[int]
    matcher: Matcher
    parser: Any  # tools.calls.ToolCallParser | None
    skip_special_tokens: bool = True  # False when the call marker is a special token

    @classmethod
    def from_args(cls, args: argparse.Namespace, tok: Tokenizer, vocab_size: int) -> StructuredRun:
        from tools.calls import ToolCallParser
        from tools.formats import detect_format, needs_special_tokens, resolve_format
        from tools.grammar import GrammarCompiler
        from tools.prompt import render_prompt
        from tools.schema import parse_tools

        compiler = GrammarCompiler(tok, vocab_size)
        messages = [{"role": "user", "content": args.prompt}]
        if args.json_schema is not None:
            schema = _read_json(args.json_schema, "--json-schema")
            grammar = compiler.json_schema(schema, where=f"--json-schema {args.json_schema}")
            return cls(tok.apply_chat_template(messages), compiler.matcher(grammar), None)
        tools = parse_tools(_read_json(args.tools, "--tools"))
        fmt = detect_format(tok) if args.tool_call_format == "auto" else resolve_format(args.tool_call_format)
        choice: Any = args.tool_choice
        if choice not in ("auto", "none", "required"):
            choice = {"type": "function", "function": {"name": choice}}
        grammar = compiler.tool_calls(fmt, tools, choice, parallel_tool_calls=not args.no_parallel_tool_calls)
        prompt, parser = render_prompt(tok, messages, tools), ToolCallParser(fmt, tools)
        return cls(prompt, compiler.matcher(grammar), parser, not needs_special_tokens(fmt, tok))

    def feed(self, text: str, last: bool) -> str:
        """Text to print now; finished calls are returned as JSON lines in place."""
        if self.parser is None:
            return text
        from tools.calls import CallDone, TextDelta

        events = self.parser.feed(text) + (self.parser.finish() if last else [])
        out = []
        for e in events:
            if isinstance(e, TextDelta):
                out.append(e.text)
            elif isinstance(e, CallDone):
                call = {"id": e.id, "name": e.name, "arguments": e.arguments}
                if e.error:
                    call["error"] = e.error
                out.append(json.dumps(call) + "\n")
        return "".join(out)
