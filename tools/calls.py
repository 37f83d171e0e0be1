"""An incremental parser from streamed model text to tool-call events.

Text goes in as it is decoded, in chunks of any size; out come `TextDelta`, `CallStarted` (id,
name), `ArgumentsDelta` and `CallDone`. The parser works one character at a time, so its result
does not depend on the chunking: the same text gives the same calls and the same concatenated text
whether it arrives a character, a token or several calls at a time. Arguments are streamed as the
raw JSON text of the call's arguments value, so the concatenated deltas equal `CallDone.arguments`
exactly (no re-serialisation). A marker prefix at the end of a chunk is held back until the next
chunk decides whether it opens a call. A custom tool's frame (`tools.custom`) is a second
marker, watched when such a tool is declared; its input streams as `ArgumentsDelta`s.

Two rules for the text around calls. Text that only looked like a call (a marker, then something
no call starts with) comes back as text byte for byte: the attempt's first character is text and
the rest is read again, so a real call later in it is still found. Whitespace is held until
non-whitespace text follows; whitespace adjacent to a call (before it, or between it and the next
call or the end of the reply) is dropped, as is what the reply ends with inside a call's end
marker, so a reply of calls alone gives no text event at all, while a reply without calls comes
back unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

from tools import custom
from tools.call_events import ArgumentsDelta, CallDone, CallStarted, Event, TextDelta, new_call_id
from tools.call_object import CallObject, Scan
from tools.custom import CustomCallReader, Read
from tools.formats import ToolCallFormat
from tools.schema import ArgumentsInvalid, ToolSpec, validate_arguments


class _S(Enum):
    TEXT = auto()  # free text, watching for the start marker
    OPEN = auto()  # after the marker, before the call object (or the array)
    OBJECT = auto()  # inside a call's JSON object
    AFTER = auto()  # after a call object: the end marker, or "," / "]" in an array
    CUSTOM = auto()  # inside a custom tool's frame (`tools.custom`)


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
        # custom tools' frame is a second marker, watched only when such a tool is declared
        has_custom = any(t.kind == "custom" for t in tools or [])
        self._markers = (fmt.start, custom.OPEN) if has_custom else (fmt.start,)
        self._custom: CustomCallReader | None = None
        self._new_id = new_id
        self._state = _S.TEXT
        self._held = ""  # TEXT: a possible marker prefix; OPEN: the text since the marker; AFTER: since the call
        self._attempt: list[str] = []  # OPEN/OBJECT: everything read since the marker (or an array's ",")
        self._call: _Call | None = None
        self._index = 0
        self._queue: deque[str] = deque()  # characters to read: the chunk, after any text to read again
        self._out: list[Event] = []
        self._text: list[str] = []
        self._ws = ""  # whitespace not yet known to be text (see the module docstring)
        self._after_call = False  # a call has ended and no text has come since

    def feed(self, chunk: str) -> list[Event]:
        """Consumes a chunk; returns the events it completes (text deltas merged per chunk)."""
        self._queue.extend(chunk)
        self._run()
        return self._drain()

    def finish(self) -> list[Event]:
        """End of the reply: held text is released; a call left open is reported as failed."""
        while self._state in (_S.OPEN, _S.OBJECT, _S.CUSTOM):
            if self._state is _S.CUSTOM:
                self._end_custom()
            elif self._call is not None and self._call.started:
                self._done(self._call, "the reply ended inside the call")
                self._state = _S.TEXT
            else:
                self._bail()
                self._run()
        if self._state is _S.TEXT:  # a marker prefix is text; after a call, an unfinished end marker is not
            self._add_text(self._held)
        self._held = ""
        if not self._after_call:
            self._text.append(self._ws)
        self._ws, self._state = "", _S.TEXT
        return self._drain()

    # ---- internals ----

    def _run(self) -> None:
        while self._queue:
            self._char(self._queue.popleft())

    def _add_text(self, text: str) -> None:
        """Text of the reply; its trailing whitespace is held until it is known not to touch a call."""
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        self._text.append(self._ws + body)
        self._ws, self._after_call = text[len(body) :], False

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
        if isinstance(event, CallStarted):
            self._ws = ""  # whitespace before a call is no text
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
            while self._held and not any(m.startswith(self._held) for m in self._markers):
                self._add_text(self._held[0])
                self._held = self._held[1:]
            if self._held == custom.OPEN and len(self._markers) > 1:
                self._attempt, self._held, self._state = list(custom.OPEN), "", _S.CUSTOM
                self._custom = CustomCallReader()
            elif self._held == fmt.start:
                self._attempt, self._held, self._state = list(fmt.start), "", _S.OPEN
                if fmt.start_in_body:
                    self._open_call(fmt.start)
        elif self._state is _S.OPEN:
            self._attempt.append(c)
            self._held += c
            if c.isspace():
                return
            if fmt.array and c == "[" and "[" not in self._held[:-1]:
                return
            if c == "{" and (not fmt.array or "[" in self._held):
                self._open_call(c)
            else:
                self._bail()
        elif self._state is _S.OBJECT:
            if self._call is not None and not self._call.started:
                self._attempt.append(c)
            self._object_char(c)
        elif self._state is _S.CUSTOM:
            self._custom_char(c)
        elif fmt.array:
            self._after_array(c)
        else:
            self._after_end(c)

    def _custom_char(self, c: str) -> None:
        reader = self._custom
        assert reader is not None
        if not reader.started:
            self._attempt.append(c)
        read = reader.push(c)
        if read is Read.BAD:
            self._custom = None
            self._bail()
        elif read is Read.STARTED:
            reader.id = self._new_id()
            self._emit(CallStarted(self._index, reader.id, reader.name))
        elif read is Read.BODY:
            if delta := reader.take():
                self._emit(ArgumentsDelta(self._index, delta))
        elif read is Read.CLOSED:
            self._finish_custom(reader, reader.take(), None)

    def _end_custom(self) -> None:
        """The reply ended inside a custom frame: a started call fails, else the frame was text."""
        reader = self._custom
        assert reader is not None
        if reader.started:
            self._finish_custom(reader, reader.rest(), "the reply ended inside the call")
        else:
            self._custom = None
            self._bail()
            self._run()

    def _finish_custom(self, reader: CustomCallReader, last: str, error: str | None) -> None:
        if last:
            self._emit(ArgumentsDelta(self._index, last))
        if error is None and self.tools is not None:
            tool = self.tools.get(reader.name)
            if tool is None or tool.kind != "custom":
                error = f"custom tool {reader.name!r} is not declared"
        self._emit(CallDone(self._index, reader.id, reader.name, "".join(reader.input), error))
        self._index += 1
        self._custom, self._attempt, self._after_call, self._state = None, [], True, _S.TEXT

    def _open_call(self, text: str) -> None:
        self._call, self._held, self._state = _Call(self._new_id(), CallObject(self.fmt.args_key)), "", _S.OBJECT
        for c in text:
            self._object_char(c)

    def _after_end(self, c: str) -> None:
        """After a call: whitespace, then the end marker if the format has one; anything else is read again."""
        self._held += c
        body = self._held.lstrip()
        if body == self.fmt.end:
            self._held, self._state = "", _S.TEXT
        elif not self.fmt.end.startswith(body):
            self._read_again(self._held)

    def _after_array(self, c: str) -> None:
        """After a call in an array: "," opens the next, "]" ends the list; anything else is read again."""
        if c == ",":
            self._attempt, self._held, self._state = [*self._held, c], "[", _S.OPEN
        elif c == "]":
            self._held, self._state = "", _S.TEXT
        elif c.isspace():
            self._held += c
        else:
            self._read_again(self._held + c)

    def _read_again(self, text: str) -> None:
        self._held, self._state = "", _S.TEXT
        self._queue.extendleft(reversed(text))

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
        self._call, self._attempt, self._after_call = None, [], True

    def _bail(self) -> None:
        """What opened like a call is not one. A started call fails; otherwise the attempt's first
        character is text and the rest is read again (it may hold text, or a real call)."""
        call = self._call
        if call is not None and call.started:
            self._done(call, "malformed tool call")
            self._held, self._state = "", _S.TEXT
            return
        attempt, self._attempt, self._call = self._attempt, [], None
        self._add_text(attempt[0])
        self._read_again("".join(attempt[1:]))
