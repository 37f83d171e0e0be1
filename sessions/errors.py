"""Typed errors of the session store and service; the HTTP layer maps each to one status, in one place.

    NotFound          404  no such object for this tenant (another tenant's id included)
    ConversationBusy  409  another response holds the conversation's lease
    LeaseLost         409  our fence no longer holds the lease: nothing was written
    Conflict          409  the write contradicts stored state (a duplicate item id, a final
                           response overwritten, an event out of sequence): nothing was written
    ChainTooLong      400  a previous_response_id chain deeper than the store walks
    RequestInProgress 409  an Idempotency-Key repeat while the first request runs
    InvalidParam      400  a request field the server cannot accept (`param` = its path)
    ContextLengthExceeded 400  (an InvalidParam, code context_length_exceeded) the context is too long
    ModelNotFound     404  the request names another model than the served one
    StoreUnavailable  503  Redis did not answer within the retry budget
    UnsuitableServer  —    refused at start: the server would lose conversations

Lua scripts report the first four as error replies `LC_<CODE> <detail>`; `from_script_error`
turns such a reply back into its typed error.
"""

from __future__ import annotations

import redis


class StoreError(Exception):
    """Base of the session store's errors."""


class NotFound(StoreError):
    def __init__(self, kind: str, id: str):
        super().__init__(f"{kind} {id!r} not found")
        self.kind = kind  # "conversation", "item", "response"
        self.id = id
        self.param: str | None = None  # the request field naming the id, when one does


class ConversationBusy(StoreError):
    def __init__(self, conversation_id: str, holder: str):
        super().__init__(f"conversation {conversation_id!r} is busy with response {holder!r}")
        self.conversation_id = conversation_id
        self.holder = holder  # the response id holding the lease


class LeaseLost(StoreError):
    def __init__(self, conversation_id: str, lease: str):
        super().__init__(f"lease {lease!r} on conversation {conversation_id!r} is no longer held")
        self.conversation_id = conversation_id
        self.lease = lease


class Conflict(StoreError):
    pass


class ChainTooLong(StoreError):
    def __init__(self, response_id: str, max_depth: int):
        super().__init__(f"previous_response_id chain from {response_id!r} is longer than {max_depth} responses")
        self.response_id = response_id
        self.max_depth = max_depth


class StoreUnavailable(StoreError):
    pass


class UnsuitableServer(StoreError):
    pass


def from_script_error(e: redis.ResponseError, subject: str) -> StoreError | None:
    """The typed error a script reported (`LC_<CODE> <detail>`), or None for any other reply.

    Args:
        e: the error reply.
        subject: the conversation or response id the script was working on.
    """
    code, _, detail = str(e).partition(" ")
    if code == "LC_NOTFOUND":
        kind, _, id = detail.partition(" ")
        return NotFound(kind, id or subject)
    if code == "LC_BUSY":
        return ConversationBusy(subject, detail)
    if code == "LC_LEASELOST":
        return LeaseLost(subject, detail)
    if code == "LC_CONFLICT":
        return Conflict(detail)
    if code == "LC_CHAIN":
        return ChainTooLong(subject, int(detail))
    return None


class RequestInProgress(Conflict):
    """409: an Idempotency-Key repeat while the first request with that key is still running."""

    def __init__(self, response_id: str):
        super().__init__(f"a request with this Idempotency-Key is still running (response {response_id!r})")
        self.response_id = response_id


class InvalidParam(ValueError):
    """A request field the server cannot accept; `param` is its path in the request body."""

    def __init__(self, param: str, message: str, code: str = "invalid_request_error"):
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.code = param, message, code


class ContextLengthExceeded(InvalidParam):
    """400 `context_length_exceeded`: the prompt and the output asked for do not fit."""

    def __init__(self, param: str, message: str):
        super().__init__(param, message, code="context_length_exceeded")


class ModelNotFound(LookupError):
    """404 `model_not_found`: the request names a model this server does not serve."""

    param = "model"

    def __init__(self, asked: str, served: str):
        super().__init__(f"the model {asked!r} does not exist; this server serves {served!r}")
        self.asked, self.served = asked, served


def check_model(model: object, served: str, required: bool = True) -> None:
    """InvalidParam for a `model` that is not a name (or missing when `required`); ModelNotFound
    for another model than `served`."""
    if model is None and not required:
        return
    if not isinstance(model, str) or not model:
        raise InvalidParam("model", f"model is required: the name of the served model ({served!r})")
    if model != served:
        raise ModelNotFound(model, served)
