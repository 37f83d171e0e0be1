"""Compaction and truncation: keeping a long conversation's prompt small.

Compaction (`context_management: [{"type": "compaction", "compact_threshold": N}]`): when the
rendered prompt is longer than N tokens,
1. tool outputs older than the second-last user message are shortened (`shorten`: their first
   and last `KEEP_CHARS` characters kept, a marker between); if the prompt now fits, that is all.
   Nothing is stored: the shortening is deterministic, and the next turn first shortens exactly
   the outputs the previous turn's prompt had shortened (`shortened_in` finds them in its text),
   so that its prompt continues the previous prompt token for token and reuses its KV; only if
   that does not fit are the outputs up to the new second-last user message shortened too;
2. otherwise everything older than the second-last user message is summarised by the model in a
   separate greedy request (engine priority 1): the older items rendered as a conversation of
   their own (no instructions, no tools) followed by a user message `SUMMARY_PROMPT`, at
   temperature 0 with at most `SUMMARY_MAX_TOKENS` tokens. That is exactly what
   `POST /v1/responses` with that input, `temperature: 0`, `max_output_tokens:
   SUMMARY_MAX_TOKENS` and `store: false` generates. The summary becomes a `compaction` output
   item (first in the output) whose `encrypted_content` is signed by this server.

Items stay listed as they were. A context renders from its latest compaction item: the summary
(`SUMMARY_HEADER` + summary, a developer message after the instructions, so it joins the
system message), then the items from the first one it kept (`keep_from`), then what came after
the compaction item. A compaction from `POST /v1/responses/compact` keeps nothing before itself:
its output is the compaction item followed by the kept items, ready to be sent as `input`.

`encrypted_content` is `lc1.<payload>.<mac>`: payload the URL-safe base64 of the JSON
`{"summary", "keep_from"}`, mac the hex HMAC-SHA256 of the payload under the store's
`compaction_secret()` (`P:secret`). The summary is signed, not encrypted: a client can read it,
and only this server's (or a replica's) items are accepted.

Truncation (`truncation: "auto"`): while the prompt does not fit, the oldest turn (a user
message and everything up to the next one, so a call goes with its output) is dropped;
instructions, system and developer messages, and the last user turn always stay.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from sessions.errors import InvalidParam
from sessions.items import CallOutput, Compaction, Item, Message

SUMMARY_PROMPT = (
    "Summarise the conversation above for your own later use: the user's goals, the facts, names and "
    "numbers learned, the tools called and what they returned, decisions made and what is still open. "
    "Write only the summary."
)
SUMMARY_HEADER = "Summary of the earlier conversation:\n"
SUMMARY_MAX_TOKENS = 128
KEEP_CHARS = 200  # of a shortened tool output, at each end
MARKER = "\n[... {n} characters omitted ...]\n"
_VERSION = "lc1"


class Payload(msgspec.Struct):
    summary: str
    keep_from: str | None = None


def sign(secret: bytes, payload: Payload) -> str:
    """`encrypted_content` for `payload` (see the module docstring)."""
    body = base64.urlsafe_b64encode(msgspec.json.encode(payload)).decode()
    mac = hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()
    return f"{_VERSION}.{body}.{mac}"


def verify(secret: bytes, content: str) -> Payload:
    """The payload of our `encrypted_content`; ValueError for anything else."""
    version, _, rest = content.partition(".")
    body, _, mac = rest.partition(".")
    if version != _VERSION or not body or not mac:
        raise ValueError("not a compaction item of this server")
    expect = hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expect, mac):
        raise ValueError("the signature does not match: not a compaction item of this server")
    try:
        return msgspec.json.decode(base64.urlsafe_b64decode(body), type=Payload)
    except (binascii.Error, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"unreadable compaction item: {e}") from None


def payloads(secret: bytes, history: Sequence[Item], input_items: Sequence[Item]) -> dict[str, Payload]:
    """The payloads of every compaction item of a context, by item id.

    Raises:
        InvalidParam: an input compaction item is not ours, naming `input[i].encrypted_content`.
    """
    out: dict[str, Payload] = {}
    for item in history:  # stored items were checked when they came in
        if isinstance(item, Compaction):
            try:
                out[item.id] = verify(secret, item.encrypted_content)
            except ValueError:
                out[item.id] = Payload("")
    for i, item in enumerate(input_items):
        if isinstance(item, Compaction):
            try:
                out[item.id] = verify(secret, item.encrypted_content)
            except ValueError as e:
                raise InvalidParam(f"input[{i}].encrypted_content", str(e)) from None
    return out


class View(NamedTuple):
    """What a context renders: the latest summary (None if none) and the items after it."""

    summary: str | None
    items: list[Item]


def view(items: Sequence[Item], found: dict[str, Payload]) -> View:
    """The context from its latest compaction item (see the module docstring)."""
    last = max((i for i, it in enumerate(items) if isinstance(it, Compaction)), default=None)
    if last is None:
        return View(None, list(items))
    payload = found.get(items[last].id, Payload(""))
    before = list(items[:last])
    start = next((i for i, it in enumerate(before) if it.id == payload.keep_from), len(before))
    rest = [it for it in items[last + 1 :] if not isinstance(it, Compaction)]
    kept = [it for it in before[start:] if not isinstance(it, Compaction)]
    return View(payload.summary or None, [*kept, *rest])


def with_summary(messages: list[dict[str, Any]], summary: str | None, instructions: str | None) -> list[dict[str, Any]]:
    """`messages` (from `to_messages(items, instructions)`) with the summary message after the
    instructions."""
    if summary is None:
        return messages
    at = 1 if instructions else 0
    return [*messages[:at], {"role": "developer", "content": SUMMARY_HEADER + summary}, *messages[at:]]


def boundary(items: Sequence[Item]) -> int:
    """The index of the second-last user message (everything from it on stays verbatim); 0 when
    there are fewer than two."""
    users = [i for i, it in enumerate(items) if isinstance(it, Message) and it.role == "user"]
    return users[-2] if len(users) >= 2 else 0


def shortened(output: str, keep: int = KEEP_CHARS) -> str | None:
    """A tool output's shortened text: its head and tail, a marker naming how much was cut
    between them; None if it is not longer than 2 x `keep` characters and the marker."""
    if len(output) <= 2 * keep + len(MARKER):
        return None
    return output[:keep] + MARKER.format(n=len(output) - 2 * keep) + output[-keep:]


def shorten(items: Sequence[Item], end: int, keep: int = KEEP_CHARS, only: set[str] | None = None) -> list[Item]:
    """`items` with each long tool output before index `end` (of those with ids in `only`, if
    given) replaced by its `shortened` text."""
    out = list(items)
    for i in range(min(end, len(out))):
        it = out[i]
        if isinstance(it, CallOutput) and (only is None or it.id in only):
            text = shortened(it.output, keep)
            if text is not None:
                out[i] = msgspec.structs.replace(it, output=text)
    return out


def shortened_in(text: str, items: Sequence[Item], keep: int = KEEP_CHARS) -> set[str]:
    """The ids of the tool outputs among `items` whose shortened text appears in `text` (a
    previous turn's prompt) while their whole output does not."""
    found = set()
    for it in items:
        if isinstance(it, CallOutput):
            short = shortened(it.output, keep)
            if short is not None and short in text and it.output not in text:
                found.add(it.id)
    return found


def summary_messages(
    summary: str | None, older: list[dict[str, Any]], prompt: str = SUMMARY_PROMPT
) -> list[dict[str, Any]]:
    """The summary request's messages: an earlier summary, the older turns, the summary prompt."""
    return [*with_summary(older, summary, None), {"role": "user", "content": prompt}]


def drop_oldest_turn(items: list[Item]) -> list[Item] | None:
    """`items` without their oldest user turn (system and developer messages stay); None when
    only one user turn is left."""
    users = [i for i, it in enumerate(items) if isinstance(it, Message) and it.role == "user"]
    if len(users) < 2:
        return None
    first, nxt = users[0], users[1]
    keep = [it for it in items[first:nxt] if isinstance(it, Message) and it.role in ("system", "developer")]
    return [*items[:first], *keep, *items[nxt:]]
