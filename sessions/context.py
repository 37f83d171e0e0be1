"""What a turn continues: the conversation's items or the `previous_response_id` chain, read in
one round trip, and the check that the new input fits after them (backfill).

The context of a turn is `history` (earlier items, oldest first) then the request's input items.
`instructions` are the request's own: never carried over from earlier turns. `previous_ids` are
the token ids (prompt + output) of the response that rendered `history`, when the store has them,
so that the next prompt continues them (`sessions.render.build_prompt`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sessions.items import Call, CallOutput, CustomToolCall, Item
from sessions.requests import InvalidParam, ResponseRequest
from sessions.store import SessionStore


class TurnContext(NamedTuple):
    history: list[Item]
    previous_ids: list[int] | None
    base_version: int | None  # the conversation's version when loaded (None outside one)


async def load_context(
    store: SessionStore, tenant: str, request: ResponseRequest, history: list[Item] | None = None
) -> TurnContext:
    """The context `request` continues: its conversation (`conversations.load`), its
    `previous_response_id` chain (`responses.load_chain`), or nothing; `history`, when given, is
    that chain's items as a WebSocket connection keeps them for a response never stored.

    Raises:
        NotFound, ChainTooLong: from the store.
        InvalidParam: the input answers no open call (see `check_backfill`).
    """
    if history is not None:
        ctx = TurnContext(list(history), None, None)
    elif request.conversation_id is not None:
        conv = await store.conversations.load(tenant, request.conversation_id)
        ctx = TurnContext(conv.items, _joined(conv.prompt_ids, conv.output_ids), conv.state.version)
    elif request.body.previous_response_id is not None:
        chain = await store.responses.load_chain(tenant, request.body.previous_response_id)
        history = [item for link in chain.links for item in (*link.input_items, *link.response.output)]
        ctx = TurnContext(history, _joined(chain.prompt_ids, chain.output_ids), None)
    else:
        ctx = TurnContext([], None, None)
    check_backfill(ctx.history, request.input_items)
    check_ids(ctx.history if request.conversation_id is not None else [], request.input_items)
    return ctx


def check_ids(history: Sequence[Item], input_items: Sequence[Item]) -> None:
    """Input item ids must be new: not in the conversation, not twice in the input (a commit
    would refuse them after the whole generation).

    Raises:
        InvalidParam: naming `input[i].id`.
    """
    seen = {item.id for item in history}
    for i, item in enumerate(input_items):
        if item.id in seen:
            raise InvalidParam(f"input[{i}].id", f"item {item.id!r} is already in the conversation or the input")
        seen.add(item.id)


def check_backfill(history: Sequence[Item], input_items: Sequence[Item]) -> None:
    """Each `function_call_output` (`custom_tool_call_output`) of the input must answer a
    `function_call` (`custom_tool_call`) that comes before it (in the history or earlier in the
    input) and that no output answered yet.

    Raises:
        InvalidParam: naming `input[i].call_id`.
    """
    open_calls: dict[str, str] = {}  # call_id: the call's item type
    answered: set[str] = set()

    def see(item: Item) -> str | None:
        if isinstance(item, Call):
            open_calls[item.call_id] = _kind(item)
        elif isinstance(item, CallOutput):
            kind = "custom_tool_call" if item.__struct_config__.tag == "custom_tool_call_output" else "function_call"
            if item.call_id in answered:
                return f"call {item.call_id!r} has already been answered"
            if open_calls.get(item.call_id) != kind:
                return f"no {kind} with call_id {item.call_id!r} precedes this output"
            open_calls.pop(item.call_id)
            answered.add(item.call_id)
        return None

    for item in history:
        see(item)  # stored history is as it was accepted; only the new input is judged
    for i, item in enumerate(input_items):
        problem = see(item)
        if problem is not None:
            raise InvalidParam(f"input[{i}].call_id", problem)


def _kind(call: Call) -> str:
    return "custom_tool_call" if isinstance(call, CustomToolCall) else "function_call"


def _joined(prompt: list[int] | None, output: list[int] | None) -> list[int] | None:
    return None if prompt is None or output is None else [*prompt, *output]
