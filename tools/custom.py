"""Custom tools: a tool whose input is free text, not JSON arguments, optionally under a grammar.

A custom tool is declared `{"type": "custom", "name", "description", "format"}` with `format`
`{"type": "text"}` (any text, the default) or `{"type": "grammar", "syntax": "lark" | "regex",
"definition"}`. The model calls one by writing its name and raw input in a frame of our own,
the same in every tool-call format, taught by the prompt (`tools.prompt`):

    <tool_input name="apply_patch">*** Begin Patch ...</tool_input>

The grammar (`tools.formats.structural_tag`) forces the frame and, inside it, the tool's format:
xgrammar reads Lark itself (`Grammar.from_lark`) and regexes (`Grammar.from_regex`); a Python
named group `(?P<name>...)`, which xgrammar's regex reader lacks, is given in its equal
`(?<name>...)` spelling. The parser (`tools.calls.ToolCallParser`) reads the frame with
`CustomCallReader` into the same events as a function call's, the input streamed as deltas.
"""

from __future__ import annotations

import re
from enum import Enum, auto
from typing import Any

import xgrammar as xgr
from xgrammar import structural_tag as st


class InvalidTool(ValueError):
    """A malformed custom tool format; `param` names the field (`tools.schema` reports it as its
    own `InvalidTool`)."""

    def __init__(self, param: str, message: str):
        self.param, self.message = param, message
        super().__init__(f"{param}: {message}")


OPEN = '<tool_input name="'
CLOSE = "</tool_input>"
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
SYNTAXES = ("lark", "regex")

INSTRUCTIONS = f"""Tools of type "custom" take free text, not JSON: call one by writing its name and its raw input as
{OPEN}tool-name">the input, exactly as the tool's format asks{CLOSE}"""


def begin(name: str) -> str:
    """The frame's opening text for a call of `name`."""
    return f'{OPEN}{name}">'


def render_call(name: str, text: str) -> str:
    """A finished custom call as the model writes it (for earlier turns in a prompt)."""
    return f"{begin(name)}{text}{CLOSE}"


def regex_for_xgrammar(pattern: str) -> str:
    """A regex in the spelling xgrammar reads: `(?P<name>` named groups as `(?<name>`."""
    return re.sub(r"\(\?P<", "(?<", pattern)


def check_format(fmt: Any, param: str) -> dict[str, Any]:
    """A custom tool's `format` checked (its grammar parsed); returns it normalised.

    Raises:
        InvalidTool: naming `param` or its field (`tools[2].format.definition`).
    """
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise InvalidTool(param, f"expected an object with a 'type', got {type(fmt).__name__}")
    kind = fmt.get("type", "text")
    if kind == "text":
        return {"type": "text"}
    if kind != "grammar":
        raise InvalidTool(f"{param}.type", f"expected text or grammar, got {kind!r}")
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in SYNTAXES:
        raise InvalidTool(f"{param}.syntax", f"expected lark or regex, got {syntax!r}")
    if not isinstance(definition, str) or not definition:
        raise InvalidTool(f"{param}.definition", "a grammar format needs its definition (a string)")
    try:
        if syntax == "lark":
            xgr.Grammar.from_lark(definition)
        else:
            xgr.Grammar.from_regex(regex_for_xgrammar(definition))
    except (RuntimeError, ValueError) as e:
        reason = str(e).strip().splitlines()
        raise InvalidTool(f"{param}.definition", f"invalid {syntax} grammar: {' '.join(reason)[:300]}") from None
    return {"type": "grammar", "syntax": syntax, "definition": definition}


def content_format(fmt: dict[str, Any] | None) -> st.Format:
    """What the frame may hold: the tool's grammar, or any text without the closing tag."""
    if fmt is None or fmt.get("type") != "grammar":
        return st.AnyTextFormat(excludes=[CLOSE])
    if fmt["syntax"] == "lark":
        return st.GrammarFormat(grammar=fmt["definition"], syntax="lark")
    return st.RegexFormat(pattern=regex_for_xgrammar(fmt["definition"]))


def call_tag(name: str, fmt: dict[str, Any] | None) -> st.TagFormat:
    """One call of a custom tool: the frame around its format."""
    return st.TagFormat(begin=begin(name), content=content_format(fmt), end=CLOSE)


class Read(Enum):
    NAME = auto()  # still reading the name
    STARTED = auto()  # the name just closed: the call has begun
    BODY = auto()  # inside the input
    CLOSED = auto()  # the closing tag was read
    BAD = auto()  # not a frame after all


class CustomCallReader:
    """The characters after `OPEN`, one at a time: the name up to `">`, then the input up to
    `CLOSE`. A possible closing tag at the end is held back until it is decided (`take` gives
    what is known to be input)."""

    def __init__(self) -> None:
        self.id = ""  # the call's id, once it has begun
        self.input: list[str] = []  # all the input handed out by `take` and `rest`
        self.name = ""
        self._quoted = False  # the name's closing quote was read
        self._body: list[str] = []
        self._held = ""
        self.started = False

    def push(self, c: str) -> Read:
        if not self.started:
            if self._quoted:
                if c != ">" or not _NAME.match(self.name):
                    return Read.BAD
                self.started = True
                return Read.STARTED
            if c == '"':
                self._quoted = True
            elif len(self.name) >= 64 or not (c.isalnum() or c in "_.:-"):
                return Read.BAD
            else:
                self.name += c
            return Read.NAME
        self._held += c
        if self._held == CLOSE:
            self._held = ""
            return Read.CLOSED
        if not CLOSE.startswith(self._held):
            keep = _partial(self._held)
            self._body.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
        return Read.BODY

    def take(self) -> str:
        """The input read since the last `take` (without any held closing-tag prefix)."""
        out = "".join(self._body)
        self._body.clear()
        self.input.append(out)
        return out

    def rest(self) -> str:
        """At the end of the reply: what was held back is input after all."""
        held, self._held = self._held, ""
        out = self.take() + held
        self.input.append(held)
        return out


def _partial(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `CLOSE`."""
    for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if text.endswith(CLOSE[:n]):
            return n
    return 0
