"""Fetching an image part's http(s) URL, within a size and a time limit, never from an address
the server should not reach on a client's behalf.

A URL's host is resolved first and every address it resolves to must be public: loopback,
link-local, private (RFC 1918, unique-local), shared, multicast, reserved and unspecified
addresses are refused unless `allow_private` (`--allow-private-image-urls`), so a request
cannot make the server read its own metadata service or a neighbour's admin page. Redirects
(at most `MAX_REDIRECTS`) are checked the same way before they are followed. The body is read
in pieces and refused as soon as it passes `max_bytes`; the whole fetch, redirects included,
gets `timeout_s`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

MAX_REDIRECTS = 3
PIECE = 64 << 10


class FetchError(ValueError):
    """The URL cannot be fetched (the message says why, for the client)."""


def check_address(host: str, port: int, allow_private: bool) -> None:
    """Raise FetchError unless every address `host` resolves to may be fetched."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise FetchError(f"cannot resolve {host!r}: {e}") from None
    if allow_private:
        return
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not ip.is_global or ip.is_multicast:
            raise FetchError(
                f"{host!r} resolves to {ip}, a non-public address; the server fetches those only with "
                "--allow-private-image-urls"
            )


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL whose host passes `check_address`."""

    def __init__(self, allow_private: bool):
        self.allow_private = allow_private
        self.count = 0

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        self.count += 1
        if self.count > MAX_REDIRECTS:
            raise FetchError(f"more than {MAX_REDIRECTS} redirects")
        _checked(newurl, self.allow_private)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _checked(url: str, allow_private: bool) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError("only http and https URLs with a host can be fetched")
    check_address(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), allow_private)
    return parts


def fetch(url: str, *, max_bytes: int, timeout_s: float, allow_private: bool) -> bytes:
    """The body of `url` (blocking; see the module docstring). Raises FetchError."""
    deadline = time.monotonic() + timeout_s
    _checked(url, allow_private)
    opener = urllib.request.build_opener(_Redirects(allow_private))
    request = urllib.request.Request(url, headers={"User-Agent": "longctx", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout_s) as r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise FetchError(f"the image is {int(length)} bytes; at most {max_bytes} (--max-image-bytes)")
            pieces, size = [], 0
            while piece := r.read(PIECE):
                size += len(piece)
                if size > max_bytes:
                    raise FetchError(f"the image is over {max_bytes} bytes (--max-image-bytes)")
                if time.monotonic() > deadline:
                    raise FetchError(f"fetching took over {timeout_s:g} s")
                pieces.append(piece)
    except urllib.error.HTTPError as e:
        raise FetchError(f"the server answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, FetchError):
            raise reason from None
        raise FetchError(f"cannot fetch it: {reason}") from None
    return b"".join(pieces)


async def fetch_async(url: str, *, max_bytes: int, timeout_s: float, allow_private: bool) -> bytes:
    """`fetch` on a worker thread, given up after `timeout_s` (the thread ends by its socket timeout)."""
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(fetch, url, max_bytes=max_bytes, timeout_s=timeout_s, allow_private=allow_private),
            timeout_s,
        )
    except TimeoutError:
        raise FetchError(f"fetching took over {timeout_s:g} s") from None
