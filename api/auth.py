"""API keys and tenants.

`--api-keys-file F` holds one `KEY TENANT` pair per line; `#` starts a comment, blank lines are
skipped, and a malformed line stops the start naming it. A request under `/v1` sends
`Authorization: Bearer KEY` and runs as that key's tenant: every conversation, response, item,
background job and event stream belongs to the tenant, and the engine's cache salt is the tenant,
so KV pages are never shared across tenants. No key or an unknown one: 401.

Without a keys file the server is one tenant (`DEFAULT_TENANT`), refuses a non-loopback `--host`
and logs that it runs unauthenticated.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from pathlib import Path
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from api.errors import ErrorSpec, register
from api.state import ServerState

log = logging.getLogger("longctx.serve")

DEFAULT_TENANT = "default"


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file and line."""


class Unauthorized(PermissionError):
    pass


register("Unauthorized", ErrorSpec(401, code="invalid_api_key", param=lambda e: None))


def load_keys(path: Path) -> dict[str, str]:
    """KEY -> TENANT from a keys file (see the module docstring).

    Raises:
        KeysFileError: unreadable, a line that is not two words, a key given twice, or no key at all.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise KeysFileError(f"{path}: cannot read the API keys file: {e}") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise KeysFileError(f"{path}:{n}: expected 'KEY TENANT', got {len(words)} word(s)")
        key, tenant = words
        if key in keys:
            raise KeysFileError(f"{path}:{n}: the key on this line was given before")
        keys[key] = tenant
    if not keys:
        raise KeysFileError(f"{path}: no 'KEY TENANT' line")
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def configure(state: ServerState) -> None:
    """Install the keys of `--api-keys-file` (or refuse an unauthenticated non-loopback host).
    Raises KeysFileError."""
    keys_file, host = state.options.api_keys_file, state.options.host
    if keys_file is not None:
        keys = load_keys(keys_file)
        state.api_keys = keys
        log.info("API keys: %d key(s) for %d tenant(s) from %s", len(keys), len(set(keys.values())), keys_file)
        return
    if not is_loopback(host):
        raise KeysFileError(f"--host {host} is not a loopback address: serving it needs --api-keys-file")
    log.warning("no --api-keys-file: the server runs unauthenticated, as one tenant, on %s only", host)


def _find(keys: dict[str, str], given: str) -> str | None:
    found = None
    for key, tenant in keys.items():  # compare with every key in constant time
        if hmac.compare_digest(key.encode(), given.encode()):
            found = tenant
    return found


def auth_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """A Litestar guard: the request's tenant into `connection.state.tenant`; 401 without a valid key."""
    if not connection.url.path.startswith("/v1"):
        return
    state: ServerState = connection.app.state.server
    keys = state.api_keys
    if keys is None:
        connection.state.tenant = DEFAULT_TENANT
        return
    connection.state.tenant = check_bearer(keys, connection.headers.get("authorization", ""))


def check_bearer(keys: dict[str, str], header: str) -> str:
    """The tenant of an `Authorization: Bearer KEY` header's key (the replicas' and the router's
    one check). Raises Unauthorized: no bearer key, or one not in `keys`."""
    scheme, _sep, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("missing API key: send 'Authorization: Bearer KEY'")
    tenant = _find(keys, given.strip())
    if tenant is None:
        raise Unauthorized("invalid API key")
    return tenant


def tenant(request: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The tenant `auth_guard` found for this request."""
    value: str = getattr(request.state, "tenant", DEFAULT_TENANT)
    return value
