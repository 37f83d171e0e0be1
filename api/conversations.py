"""The Conversations API routes, thin over `sessions.conversation_api.ConversationAPI`.

POST   /v1/conversations                          create (items, metadata)
GET / POST / DELETE /v1/conversations/{id}        get, update metadata, delete
GET / POST /v1/conversations/{id}/items           list (after, limit, order), add
GET / DELETE /v1/conversations/{id}/items/{item}  get, delete
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Router, delete, get, post

from api.app import ready_guard
from api.auth import tenant
from api.responses import page_body, service
from sessions.conversation_api import ConversationAPI
from sessions.requests import InvalidParam


def api(request: Request[Any, Any, Any]) -> ConversationAPI:
    return service(request).conversations


async def body(request: Request[Any, Any, Any]) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = msgspec.json.decode(raw) if raw.strip() else {}
    except msgspec.DecodeError as e:
        raise InvalidParam("body", f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidParam("body", "expected a JSON object")
    return data


@post("/conversations", status_code=200)
async def create_conversation(request: Request[Any, Any, Any]) -> Any:
    b = await body(request)
    return await api(request).create(tenant(request), b.get("items"), b.get("metadata"))


@get("/conversations/{conv_id:str}")
async def get_conversation(request: Request[Any, Any, Any], conv_id: str) -> Any:
    return await api(request).get(tenant(request), conv_id)


@post("/conversations/{conv_id:str}", status_code=200)
async def update_conversation(request: Request[Any, Any, Any], conv_id: str) -> Any:
    return await api(request).update(tenant(request), conv_id, (await body(request)).get("metadata"))


@delete("/conversations/{conv_id:str}", status_code=200)
async def delete_conversation(request: Request[Any, Any, Any], conv_id: str) -> dict[str, Any]:
    return await api(request).delete(tenant(request), conv_id)


@get("/conversations/{conv_id:str}/items")
async def list_items(
    request: Request[Any, Any, Any], conv_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
) -> dict[str, Any]:
    return page_body(await api(request).list_items(tenant(request), conv_id, after, limit, order))


@post("/conversations/{conv_id:str}/items", status_code=200)
async def add_items(request: Request[Any, Any, Any], conv_id: str) -> dict[str, Any]:
    return page_body(await api(request).add_items(tenant(request), conv_id, (await body(request)).get("items")))


@get("/conversations/{conv_id:str}/items/{item_id:str}")
async def get_item(request: Request[Any, Any, Any], conv_id: str, item_id: str) -> Any:
    return await api(request).get_item(tenant(request), conv_id, item_id)


@delete("/conversations/{conv_id:str}/items/{item_id:str}", status_code=200)
async def delete_item(request: Request[Any, Any, Any], conv_id: str, item_id: str) -> Any:
    return await api(request).delete_item(tenant(request), conv_id, item_id)


router = Router(
    path="/v1",
    route_handlers=[create_conversation, get_conversation, update_conversation, delete_conversation, list_items,
                    add_items, get_item, delete_item],
    guards=[ready_guard],
)  # fmt: skip
