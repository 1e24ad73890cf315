"""The generated OpenAPI description against the running service (schemathesis), and offline /docs.

Every operation of /openapi.json is exercised with generated requests (bounded: a few
examples each); none may answer 5xx, and every answer must match the documented status
codes, content types and schemas.
"""
from __future__ import annotations

import re

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.transport.serialization import serialize_binary
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)



@schemathesis.serializer("application/x-safetensors", "application/x-npy")
def _tensor_file_bytes(ctx, value) -> bytes:
    """Generated bodies for the tensor-file media types go out as raw bytes (like octet-stream)."""
    return serialize_binary(value)


# Zero 5xx everywhere (the contract); full conformance on the inference and health routes,
# whose documentation this suite owns (other routes' response docs are their owners' to test).
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]
STRICT_PATHS = re.compile(r"^/(infer|v2(/.*)?|healthz|readyz|gang)$")
EXAMPLES_PER_OPERATION = 12


def test_no_5xx_and_responses_match_the_schema(app_url: str) -> None:
    """Each documented operation, a few generated requests each (schemathesis' own lazy pytest
    loader does not work with pytest 9, so operations are driven through hypothesis here)."""
    schema = schemathesis.openapi.from_url(app_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len([op for op in operations if STRICT_PATHS.match(op.path)]) >= 13, [op.label for op in operations]
    failures = []
    for operation in operations:
        checks = [not_a_server_error, *(CONFORMANCE if STRICT_PATHS.match(operation.path) else [])]
        try:
            _exercise(operation, checks)
        except Exception as exc:  # collect every operation's failure, then report them all
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)


def _exercise(operation, checks: list) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        case.call_and_validate(checks=checks, timeout=60)

    run()


def test_docs_work_offline(app_url: str) -> None:
    """/docs references only this server's own static files (no CDN), and they are served."""
    page = httpx.get(app_url + "/docs", timeout=30)
    assert page.status_code == 200 and "swagger-ui" in page.text.lower()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and not [a for a in assets if "//" in a], assets
    for asset in assets:
        r = httpx.get(app_url + asset, timeout=30)
        assert r.status_code == 200 and len(r.content) > 1000, asset
    bundle = httpx.get(app_url + next(a for a in assets if a.endswith(".js")), timeout=30).text
    assert "isOAS31" in bundle  # FastAPI emits OpenAPI 3.1: the bundled UI must render it
    assert httpx.get(app_url + "/openapi.json", timeout=30).json()["openapi"].startswith("3.1")
