"""The generated OpenAPI description against the running service (schemathesis), and offline /docs.

Every operation of /openapi.json is exercised with generated requests (bounded: a few
examples each); none may answer 5xx, and every answer must match the documented status
codes, content types and schemas.
"""
from __future__ import annotations

import re
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.transport.serialization import serialize_binary
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.ray


@schemathesis.serializer("application/x-safetensors", "application/x-npy")
def _tensor_file_bytes(ctx, value) -> bytes:
    """Generated bodies for the tensor-file media types go out as raw bytes (like octet-stream)."""
    return serialize_binary(value)


# Zero 5xx everywhere (the contract); full conformance on the inference and health routes,
# whose documentation this suite owns (other routes' response docs are their owners' to test).
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]
STRICT_PATHS = re.compile(r"^/(infer|v2(/.*)?|healthz|readyz|gang)$")
EXAMPLES_PER_OPERATION = 12
# Transient answers a real client retries (overload or a gang that is momentarily not ready,
# both documented with Retry-After), and transport timeouts on a loaded 2-core CI box.
TRANSIENT_STATUSES = {429, 503}
TRANSIENT_RETRIES = 4


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
            _exercise(operation, checks, app_url)
        except Exception as exc:  # collect every operation's failure, then report them all
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)


def _exercise(operation, checks: list, base_url: str) -> None:
    """Generated requests for one operation, checked against the schema.

    Deterministic by construction, because a check that fails only once is what hypothesis
    reports as "Failed on the first call but did not on a subsequent one":
    - `derandomize=True`: the same examples on every run and every clone;
    - a transient answer (429/503 with Retry-After, or a timeout under CPU load) is retried
      like a client would (so is a connection the proxy dropped without an answer), after the
      service says it is ready again, and only the final
      answer is checked. A 503 that persists still fails `not_a_server_error`.
    """
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = _call_retrying_transients(case, base_url)
        case.validate_response(response, checks=checks)

    run()


def _call_retrying_transients(case, base_url: str):
    for attempt in range(TRANSIENT_RETRIES + 1):
        last = attempt == TRANSIENT_RETRIES
        try:
            response = case.call(timeout=60)
        except (requests.exceptions.Timeout, requests.exceptions.ConnectionError):  # case.call speaks `requests`
            if last:
                raise
            _wait_ready(base_url)
            continue
        retry_after = response.headers.get("retry-after")
        if last or response.status_code not in TRANSIENT_STATUSES or not retry_after:
            return response
        _wait_ready(base_url)
    raise AssertionError("unreachable")


def _wait_ready(base_url: str, budget_s: float = 60.0) -> None:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url.rstrip("/") + "/readyz", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


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
