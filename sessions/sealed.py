"""Reasoning a client carries for us: `encrypted_content` of `reasoning` items.

With `include: ["reasoning.encrypted_content"]` (what a `store: false` client such as the Codex
CLI asks for), each reasoning item of the output carries its text sealed: `lcr1.<token>`, the
token the URL-safe base64 of a 12-byte nonce and the AES-256-GCM ciphertext (with its tag) of the
JSON `{"text"}`, the tenant as associated data. The key is made once per deployment and kept in
the state Redis (`P:rkey`, like the compaction items' `P:secret`), so any replica reads what
another wrote. When the item comes back as input with only its `encrypted_content`, its text is
opened and rendered as the model wrote it; content a client altered, or one of another tenant
or server, fails authentication and is a 400 naming the item's `encrypted_content`.
"""

from __future__ import annotations

import base64
import binascii
import os

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sessions.errors import InvalidParam
from sessions.items import Item, Reasoning, ReasoningText

_VERSION = "lcr1"


class _Sealed(msgspec.Struct):
    text: str


class Sealer:
    """Seals and opens reasoning text under one key (32 bytes) for one tenant."""

    def __init__(self, key: bytes, tenant: str):
        self._aead, self._aad = AESGCM(key), tenant.encode()

    def seal(self, text: str) -> str:
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, msgspec.json.encode(_Sealed(text)), self._aad)
        return f"{_VERSION}.{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def open(self, content: str) -> str:
        """The text sealed in `content`; ValueError for anything this server did not seal."""
        version, _, token = content.partition(".")
        if version != _VERSION or not token:
            raise ValueError("not reasoning sealed by this server")
        try:
            raw = base64.urlsafe_b64decode(token)
            plain = self._aead.decrypt(raw[:12], raw[12:], self._aad)
            return msgspec.json.decode(plain, type=_Sealed).text
        except (binascii.Error, ValueError, InvalidTag, msgspec.DecodeError, msgspec.ValidationError):
            raise ValueError(
                "the encrypted content does not authenticate: not sealed by this server for this tenant"
            ) from None


def open_reasoning(items: list[Item], sealer: Sealer) -> None:
    """Input reasoning items that carry only their `encrypted_content` get their text back, in place.

    Raises:
        InvalidParam: content this server did not seal, naming `input[i].encrypted_content`.
    """
    for i, item in enumerate(items):
        if isinstance(item, Reasoning) and isinstance(item.encrypted_content, str) and not item.content:
            try:
                text = sealer.open(item.encrypted_content)
            except ValueError as e:
                raise InvalidParam(f"input[{i}].encrypted_content", str(e)) from None
            items[i] = msgspec.structs.replace(item, content=[ReasoningText(text=text)])
