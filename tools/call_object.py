"""One tool call's JSON object, scanned a character at a time.

The scanner follows only the object's nesting and string state; it is no JSON validator (a call's
arguments are validated once it is done). It reports the call's `name` as soon as that string
closes, and collects the raw text of the arguments value (under `args_key`) as it arrives, so that
the parser can stream it before the object ends. Whitespace after the arguments value is held
until the value goes on, so the collected text is the value exactly, without the padding before
`,` or `}`.
"""

from __future__ import annotations

import json
from enum import Enum, auto


class Scan(Enum):
    MORE = auto()  # the object goes on
    CLOSED = auto()  # its closing brace
    BAD = auto()  # a character no call object can hold here


class _P(Enum):  # where the scanner is at depth 1
    KEY, COLON, VALUE = auto(), auto(), auto()


class CallObject:
    """A call's JSON object as far as it has been read.

    Attributes:
        raw: every character pushed.
        name: the call's name, once its string has closed.
        args: the arguments value's text so far (`take_args` hands it out incrementally).
    """

    def __init__(self, args_key: str):
        self.args_key = args_key
        self.raw: list[str] = []
        self.name: str | None = None
        self.args: list[str] = []
        self._taken = 0  # args[:taken] were handed out by take_args
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._phase = _P.KEY
        self._key: str | None = None
        self._mark = 0  # raw index where the current key or value began
        self._value_started = False
        self._held_ws = ""  # whitespace after the arguments value: kept only if the value goes on

    @property
    def arguments(self) -> str:
        return "".join(self.args)

    def take_args(self) -> str:
        """The arguments text added since the last call."""
        text = "".join(self.args[self._taken :])
        self._taken = len(self.args)
        return text

    def push(self, c: str) -> Scan:
        """Reads one character."""
        self.raw.append(c)
        in_args = self._phase is _P.VALUE and self._key == self.args_key and self._depth >= 1
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._depth == 1 and not self._string_closed():
                    return Scan.BAD
            if in_args:
                self.args.append(c)
            return Scan.MORE
        if c.isspace():
            if in_args and self._value_started:
                if self._depth >= 2:
                    self.args.append(c)
                else:
                    self._held_ws += c
            return Scan.MORE
        if self._depth == 0:
            if c != "{":
                return Scan.BAD
            self._depth, self._phase = 1, _P.KEY
        elif self._depth >= 2:
            self._in_str = c == '"'
            self._depth += 1 if c in "{[" else -1 if c in "}]" else 0
            if in_args:
                self.args.append(c)
        elif self._phase is _P.KEY:
            if c == '"':
                self._in_str, self._mark = True, len(self.raw) - 1
            elif c == "}":
                return Scan.CLOSED
            elif c != ",":
                return Scan.BAD
        elif self._phase is _P.COLON:
            if c != ":":
                return Scan.BAD
            self._phase, self._value_started = _P.VALUE, False
        elif c in ",}" and self._value_started:
            self._held_ws = ""
            self._phase, self._key = _P.KEY, None
            if c == "}":
                return Scan.CLOSED
        else:
            if not self._value_started:
                self._value_started, self._mark = True, len(self.raw) - 1
            self._in_str = c == '"'
            self._depth += 1 if c in "{[" else 0
            if in_args:
                self.args.append(self._held_ws + c)
                self._held_ws = ""
        return Scan.MORE

    def _string_closed(self) -> bool:
        """A key or a value string ended at depth 1; False when it is not a JSON string."""
        try:
            value = json.loads("".join(self.raw[self._mark :]))
        except json.JSONDecodeError:  # a raw control character, a bad escape, or junk before the quote
            return False
        if self._phase is _P.KEY:
            self._key, self._phase = value, _P.COLON
        elif self._key == "name" and self.name is None:
            if not isinstance(value, str):
                return False
            self.name = value
        return True
