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
from api.responses import ERRORS, page_body, service
from api.schemas import ConversationBody, Deleted, ItemList, ItemsBody
from sessions.conversation_api import ConversationAPI
from sessions.items import Item
from sessions.models import Conversation


def api(request: Request[Any, Any, Any]) -> ConversationAPI:
    return service(request).conversations


@post("/conversations", status_code=200, responses=ERRORS)
async def create_conversation(request: Request[Any, Any, Any], data: ConversationBody | None = None) -> Conversation:
    b = data or ConversationBody()
    return await api(request).create(tenant(request), b.items, b.metadata)


@get("/conversations/{conv_id:str}", responses=ERRORS)
async def get_conversation(request: Request[Any, Any, Any], conv_id: str) -> Conversation:
    return await api(request).get(tenant(request), conv_id)


@post("/conversations/{conv_id:str}", status_code=200, responses=ERRORS)
async def update_conversation(
    request: Request[Any, Any, Any], conv_id: str, data: ConversationBody | None = None
) -> Conversation:
    return await api(request).update(tenant(request), conv_id, (data or ConversationBody()).metadata)


@delete("/conversations/{conv_id:str}", status_code=200, responses=ERRORS)
async def delete_conversation(request: Request[Any, Any, Any], conv_id: str) -> Deleted:
    return msgspec.convert(await api(request).delete(tenant(request), conv_id), Deleted)


@get("/conversations/{conv_id:str}/items", responses=ERRORS)
async def list_items(
    request: Request[Any, Any, Any], conv_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
) -> ItemList:
    return page_body(await api(request).list_items(tenant(request), conv_id, after, limit, order))


@post("/conversations/{conv_id:str}/items", status_code=200, responses=ERRORS)
async def add_items(request: Request[Any, Any, Any], conv_id: str, data: ItemsBody | None = None) -> ItemList:
    return page_body(await api(request).add_items(tenant(request), conv_id, (data or ItemsBody()).items))


@get("/conversations/{conv_id:str}/items/{item_id:str}", responses=ERRORS)
async def get_item(request: Request[Any, Any, Any], conv_id: str, item_id: str) -> Item:
    return await api(request).get_item(tenant(request), conv_id, item_id)


@delete("/conversations/{conv_id:str}/items/{item_id:str}", status_code=200, responses=ERRORS)
async def delete_item(request: Request[Any, Any, Any], conv_id: str, item_id: str) -> Conversation:
    return await api(request).delete_item(tenant(request), conv_id, item_id)


router = Router(
    path="/v1",
    route_handlers=[
        create_conversation,
        get_conversation,
        update_conversation,
        delete_conversation,
        list_items,
        add_items,
        get_item,
        delete_item,
    ],
    guards=[ready_guard],
)
