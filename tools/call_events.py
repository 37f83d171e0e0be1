"""The events `tools.calls.ToolCallParser` turns a reply's text into: text, and each call's
start, argument (or custom input) deltas and end."""

from __future__ import annotations

import uuid
from typing import NamedTuple


class TextDelta(NamedTuple):
    text: str


class CallStarted(NamedTuple):
    call_index: int
    id: str
    name: str


class ArgumentsDelta(NamedTuple):
    call_index: int
    delta: str


class CallDone(NamedTuple):
    """A finished call; `error` (naming the tool and JSON path) when it is unknown or its arguments invalid."""

    call_index: int
    id: str
    name: str
    arguments: str
    error: str | None = None


Event = TextDelta | CallStarted | ArgumentsDelta | CallDone


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
