"""The router's own key check (`longctx route --api-keys-file`, the replicas' file): the replicas'
check (`api.auth.check_bearer`) and their 401 body, so a request without a valid key is refused
before any replica sees it, exactly as a replica would refuse it."""

from __future__ import annotations

import json

from api.auth import Unauthorized, check_bearer
from api.errors import error_body, spec_for


def refusal(keys: dict[str, str] | None, authorization: str | None) -> bytes | None:
    """The 401 body a replica with `keys` answers a `/v1` request with this `Authorization`
    header (byte for byte: `api.errors`' compact JSON), or None: let it through (also when
    there are no keys: the replicas check alone)."""
    if keys is None:
        return None
    try:
        check_bearer(keys, authorization or "")
    except Unauthorized as e:
        spec = spec_for(e)
        assert spec is not None
        return json.dumps(error_body(str(e), spec.type, None, spec.code), separators=(",", ":")).encode()
    return None
