"""An incremental parser from streamed model text to tool-call events.

Text goes in as it is decoded, in chunks of any size; out come `TextDelta`, `CallStarted` (id,
name), `ArgumentsDelta` and `CallDone`. The parser works one character at a time, so its result
does not depend on the chunking: the same text gives the same calls and the same concatenated text
whether it arrives a character, a token or several calls at a time. Arguments are streamed as the
raw JSON text of the call's arguments value, so the concatenated deltas equal `CallDone.arguments`
exactly (no re-serialisation). A marker prefix at the end of a chunk is held back until the next
chunk decides whether it opens a call.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import NamedTuple

from tools.call_object import CallObject, Scan
from tools.formats import ToolCallFormat
from tools.schema import ArgumentsInvalid, ToolSpec, validate_arguments


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


class _S(Enum):
    TEXT = auto()  # free text, watching for the start marker
    OPEN = auto()  # after the marker, before the call object (or the array)
    OBJECT = auto()  # inside a call's JSON object
    AFTER = auto()  # after a call object: the end marker, or "," / "]" in an array


@dataclass(slots=True)
class _Call:
    """A call being read: its id, its object scanner, and whether `CallStarted` went out."""

    id: str
    obj: CallObject
    started: bool = False


class ToolCallParser:
    """Turns one reply's streamed text into events; one parser per reply.

    Args:
        fmt: the tool-call format the reply is written in.
        tools: the declared tools; when given, a call's name and arguments are validated at `CallDone`.
        new_id: makes call ids (tests pass a deterministic one).
    """

    def __init__(
        self, fmt: ToolCallFormat, tools: list[ToolSpec] | None = None, new_id: Callable[[], str] = new_call_id
    ):
        self.fmt = fmt
        self.tools = {t.name: t for t in tools} if tools is not None else None
        self._new_id = new_id
        self._state = _S.TEXT
        self._held = ""  # TEXT: a possible marker prefix; OPEN/AFTER: the marker text so far
        self._call: _Call | None = None
        self._index = 0
        self._out: list[Event] = []
        self._text: list[str] = []

    def feed(self, chunk: str) -> list[Event]:
        """Consumes a chunk; returns the events it completes (text deltas merged per chunk)."""
        for c in chunk:
            self._char(c)
        return self._drain()

    def finish(self) -> list[Event]:
        """End of the reply: held text is released; a call left open is reported as failed."""
        call = self._call
        if call is not None and call.started:
            self._done(call, "the reply ended inside the call")
        elif call is not None or self._state is _S.OPEN:
            self._bail()
        self._text.append(self._held)  # a marker prefix (TEXT) or a partial end marker (AFTER)
        self._held, self._state = "", _S.TEXT
        return self._drain()

    # ---- internals ----

    def _flush_text(self) -> None:
        text = "".join(self._text)
        self._text.clear()
        if text:
            self._out.append(TextDelta(text))

    def _drain(self) -> list[Event]:
        self._flush_text()
        out, self._out = self._out, []
        return out

    def _emit(self, event: Event) -> None:
        self._flush_text()  # keep text and calls in order
        last = self._out[-1] if self._out else None
        if (
            isinstance(event, ArgumentsDelta)
            and isinstance(last, ArgumentsDelta)
            and last.call_index == event.call_index
        ):
            self._out[-1] = ArgumentsDelta(event.call_index, last.delta + event.delta)  # one delta per chunk
        else:
            self._out.append(event)

    def _char(self, c: str) -> None:
        fmt = self.fmt
        if self._state is _S.TEXT:
            self._held += c
            while self._held and not fmt.start.startswith(self._held):
                self._text.append(self._held[0])
                self._held = self._held[1:]
            if self._held == fmt.start:
                self._held, self._state = "", _S.OPEN
                if fmt.start_in_body:
                    self._call = _Call(self._new_id(), CallObject(fmt.args_key))
                    self._state = _S.OBJECT
                    for m in fmt.start:
                        self._object_char(m)
        elif self._state is _S.OPEN:
            self._held += c
            if c.isspace():
                return
            if fmt.array and c == "[" and "[" not in self._held[:-1]:
                return
            if c == "{" and (not fmt.array or "[" in self._held):
                self._call, self._held = _Call(self._new_id(), CallObject(fmt.args_key)), ""
                self._state = _S.OBJECT
                self._object_char(c)
            elif fmt.array and c == "]" and "[" in self._held:
                self._held, self._state = "", _S.TEXT
            else:
                self._bail()
        elif self._state is _S.OBJECT:
            self._object_char(c)
        else:
            self._after_char(c)

    def _after_char(self, c: str) -> None:
        fmt = self.fmt
        if fmt.array:
            if c.isspace():
                return
            if c == ",":
                self._state = _S.OPEN
                self._held = "["
            else:  # "]" closes the list; anything else is text after it
                self._text.append("" if c == "]" else c)
                self._state = _S.TEXT
            return
        if not self._held and c.isspace():
            return
        self._held += c
        if self._held == fmt.end:
            self._held, self._state = "", _S.TEXT
        elif not fmt.end.startswith(self._held):
            self._text.append(self._held)
            self._held, self._state = "", _S.TEXT

    def _object_char(self, c: str) -> None:
        call = self._call
        assert call is not None
        scan = call.obj.push(c)
        if not call.started and call.obj.name is not None:
            call.started = True
            self._emit(CallStarted(self._index, call.id, call.obj.name))
        if call.started and (delta := call.obj.take_args()):
            self._emit(ArgumentsDelta(self._index, delta))
        if scan is Scan.CLOSED:
            self._close(call)
        elif scan is Scan.BAD:
            self._bail()

    def _close(self, call: _Call) -> None:
        if call.obj.name is None:
            return self._bail()
        if not call.obj.args:
            call.obj.args.append("{}")
            self._emit(ArgumentsDelta(self._index, call.obj.take_args()))
        self._done(call, self._check(call.obj.name, call.obj.arguments))
        self._state = _S.AFTER if self.fmt.end or self.fmt.array else _S.TEXT

    def _check(self, name: str, arguments: str) -> str | None:
        if self.tools is None:
            return None
        tool = self.tools.get(name)
        if tool is None:
            return f"tool {name!r} is not declared"
        try:
            validate_arguments(tool, arguments)
        except ArgumentsInvalid as e:
            return str(e)
        return None

    def _done(self, call: _Call, error: str | None) -> None:
        self._emit(CallDone(self._index, call.id, call.obj.name or "", call.obj.arguments, error))
        self._index += 1
        self._call = None

    def _bail(self) -> None:
        """Text that opened like a call but is not one: a started call fails; otherwise it is text."""
        call = self._call
        if call is not None and call.started:
            self._done(call, "malformed tool call")
        else:
            lead = "" if self.fmt.start_in_body and call is not None else self.fmt.start
            self._text.append(lead + (self._held if call is None else "".join(call.obj.raw)))
            self._call = None
        self._held, self._state = "", _S.TEXT
