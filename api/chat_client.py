"""`longctx chat`: a terminal client on the `openai` package, over the Responses API.

    longctx chat [--base-url URL] [--api-key K] [--conversation conv_...] [--tools F] [--model M]

Starts a conversation (or resumes one by id), reads one user message per line from stdin,
streams each reply, shows tool calls as they stream and asks for each call's result (one line),
and prints the conversation id to come back to when stdin ends. `--tools F` is a JSON file with a
list of function tools in the Responses API's shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none", help="the server's API key (see --api-keys-file)")
    p.add_argument("--conversation", default=None, help="resume this conversation (conv_...)")
    p.add_argument("--tools", type=Path, default=None, help="JSON file: a list of function tools")
    p.add_argument("--model", default=None, help="default: the server's model")
    p.add_argument("--max-output-tokens", type=int, default=512)


def _turn(client: Any, kw: dict[str, Any], input: Any, out: TextIO) -> list[Any]:
    """One response streamed to `out`; returns its function calls."""
    calls: list[Any] = []
    with client.responses.stream(input=input, **kw) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                out.write(event.delta)
            elif event.type == "response.output_item.added" and event.item.type == "function_call":
                out.write(f"\n[tool call {event.item.name}] ")
            elif event.type == "response.function_call_arguments.delta":
                out.write(event.delta)
            elif event.type == "response.output_item.done" and event.item.type == "function_call":
                calls.append(event.item)
            out.flush()
    out.write("\n")
    return calls


def run(args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    tools = json.loads(args.tools.read_text()) if args.tools is not None else []
    conv = args.conversation or client.conversations.create(items=[]).id
    kw: dict[str, Any] = {"model": model, "conversation": conv, "max_output_tokens": args.max_output_tokens}
    if tools:
        kw["tools"] = tools
    interactive = stdin.isatty()
    try:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = stdin.readline()
            if not line:
                break
            if not line.strip():
                continue
            calls = _turn(client, kw, line.rstrip("\n"), out)
            while calls:  # each call's result from the user, then the model goes on
                results = []
                for call in calls:
                    out.write(f"result of {call.name}({call.arguments}): ")
                    out.flush()
                    results.append(
                        {
                            "type": "function_call_output",
                            "call_id": call.call_id,
                            "output": stdin.readline().rstrip("\n"),
                        }
                    )
                calls = _turn(client, kw, results, out)
    except KeyboardInterrupt:
        pass
    except openai.APIError as e:
        out.write(f"\nerror: {e}\n")
        out.write(f"conversation: {conv}\n")
        return 1
    out.write(f"conversation: {conv}\n")
    return 0
