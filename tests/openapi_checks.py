"""Checks of a running server's OpenAPI schema (`/schema/openapi.json`): every route's 2xx
response has a concrete schema, and a bounded schemathesis run finds no 5xx (other than a
`grammar_dead_end`) and no response outside the schema."""

from __future__ import annotations

import time
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import response_schema_conformance

SCHEMA_PATH = "/schema/openapi.json"
EXAMPLES_PER_OPERATION = 10
BUDGET_S = 45.0  # the whole run; operations left when it is spent are not tried
SKIP = ("/metrics", "/schema")  # Prometheus text and the schema itself


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = spec["components"]["schemas"][name]
    return schema


def concrete(spec: dict[str, Any], schema: dict[str, Any] | None) -> bool:
    """A schema that says something: a type, properties, or a union of concrete schemas."""
    if not schema:
        return False
    schema = _resolve(spec, schema)
    for union in ("oneOf", "anyOf"):
        if union in schema:
            return all(concrete(spec, s) for s in schema[union])
    return bool(schema.get("type") or schema.get("properties") or schema.get("const") is not None)


def check_schemas_typed(url: str) -> None:
    """Every operation's 2xx response, and every request body, has a concrete schema."""
    spec = httpx.get(url + SCHEMA_PATH, timeout=30).json()
    untyped = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            label = f"{method.upper()} {path}"
            ok = [r for code, r in op["responses"].items() if code.startswith("2")]
            if not ok:
                untyped.append(f"{label}: no 2xx response")
            for r in ok:
                for media, content in r.get("content", {}).items():
                    if not concrete(spec, content.get("schema")):
                        untyped.append(f"{label} -> {media}: {content.get('schema')}")
            body = op.get("requestBody")
            if body is not None:
                for media, content in body.get("content", {}).items():
                    if not concrete(spec, content.get("schema")):
                        untyped.append(f"{label} body {media}: {content.get('schema')}")
            if method == "post" and path.startswith("/v1/") and "{" not in path and body is None:
                untyped.append(f"{label}: no request body schema")
    assert not untyped, "untyped schemas:\n" + "\n".join(untyped)


def _not_a_server_error(response: Any) -> None:
    if response.status_code < 500:
        return
    code = None
    if "json" in response.headers.get("content-type", ""):
        code = (response.json().get("error") or {}).get("code")
    assert code == "grammar_dead_end", f"{response.status_code}: {response.text[:500]}"


def run_schemathesis(url: str, headers: dict[str, str]) -> None:
    """Bounded examples per operation against the served schema (see the module docstring)."""
    schema = schemathesis.openapi.from_url(url + SCHEMA_PATH)
    started = time.monotonic()
    failures: list[str] = []
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()  # type: ignore[union-attr]  # an Err raises here, naming the operation
        if op.path.startswith(SKIP):
            continue
        if time.monotonic() - started > BUDGET_S:
            break
        ran += 1

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=op.as_strategy(), _=st.just(None))
        def check(case: Any, _: None) -> None:
            response = case.call(base_url=url, headers=headers, timeout=60)
            _not_a_server_error(response)
            case.validate_response(response, checks=[response_schema_conformance], headers=headers)

        try:
            check()
        except Exception as e:  # one failure per operation, all reported at the end
            failures.append(f"{op.method.upper()} {op.path}: {str(e)[:1500]}")
    assert ran >= 5, f"only {ran} operations tried within {BUDGET_S}s"
    assert not failures, "\n\n".join(failures)
