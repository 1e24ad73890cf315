"""The auth matrix: every guarded route x {no token, a wrong token, the right token}, on the
ingress's real FastAPI app (service.ingress.api.create_api, run in-process: no Ray), with
both tokens set. Without the right token the answer is 401 before the route runs; with it,
the route itself answers (whatever it says without a gang or a JobManager behind it).

The routes are written out here, and a second test checks that the app has no route this
list does not classify, so a new route must be declared guarded or open."""
from __future__ import annotations

import re
from typing import Iterator

import pytest
from starlette.testclient import TestClient

from tests.conftest import TEST_API_TOKEN, local_yaml_args

pytestmark = pytest.mark.unit

INFER_TOKEN = "infer-token-0123456789"
JOB, DATASET, SESSION = "job-0123abcd4567", "ds-0123abcd4567", "gang0-0123abcd4567"

# (method, path) -> the token it needs; paths as the client sends them.
API_ROUTES = [
    ("GET", "/train"), ("POST", "/train"), ("GET", f"/train/{JOB}"), ("DELETE", f"/train/{JOB}"),
    ("POST", f"/train/{JOB}/cancel"), ("GET", f"/train/{JOB}/checkpoint"), ("GET", f"/train/{JOB}/logs"),
    ("GET", "/datasets"), ("POST", "/datasets"), ("DELETE", f"/datasets/{DATASET}"),
    ("GET", "/weights"), ("POST", "/weights"),
    # Not routes, but under the guarded prefixes: refused before the router says 404.
    ("POST", "/train/"), ("GET", "/weights/anything"),
]
INFER_ROUTES = [
    ("POST", "/infer"), ("POST", "/v2/models/attention/infer"), ("POST", "/v2/models/attention/versions/1/infer"),
    ("POST", "/sessions"), ("POST", f"/sessions/{SESSION}/append"), ("GET", f"/sessions/{SESSION}"),
    ("DELETE", f"/sessions/{SESSION}"),
]
# Open to anyone (the full /gang only with the API token: tested with the service).
OPEN_ROUTES = [
    ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/gangs"), ("GET", "/gang"), ("GET", "/metrics"),
    ("GET", "/v2"), ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2/models/attention"),
    ("GET", "/v2/models/attention/versions/{version}"), ("GET", "/v2/models/attention/ready"),
    ("GET", "/v2/models/attention/versions/{version}/ready"),
]
CASES = [(m, p, "api") for m, p in API_ROUTES] + [(m, p, "infer") for m, p in INFER_ROUTES]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GANGSERVE_API_TOKEN", TEST_API_TOKEN)
        mp.setenv("GANGSERVE_INFER_TOKEN", INFER_TOKEN)
        from service.app import parse_args
        from service.ingress.api import create_api

        # No gang and no JobManager: a request the route admits fails after auth, not before.
        app = create_api(parse_args(local_yaml_args()), gang=None)  # type: ignore[arg-type]
        with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as c:
            yield c


def _refused(reply, code: str) -> None:  # type: ignore[no-untyped-def]
    assert reply.status_code == 401, (reply.status_code, reply.text)
    assert reply.json() == {"error": reply.json()["error"], "code": code} and reply.json()["error"]
    assert reply.headers["www-authenticate"].lower().startswith("bearer")


@pytest.mark.parametrize("method, path, needs", CASES, ids=[f"{m} {p}" for m, p, _ in CASES])
def test_every_guarded_route_needs_its_token(client: TestClient, method: str, path: str, needs: str) -> None:
    body = b'{"job_id": "job-0123abcd4567"}'
    # No token: no header, or another scheme.
    for headers in ({}, {"authorization": f"Basic {TEST_API_TOKEN}"}, {"authorization": "Bearer "}):
        _refused(client.request(method, path, headers=headers, content=body), "missing_token")
    # A wrong token: a bearer token that is not the one; the inference token opens no API route.
    wrong = ["not-the-token", TEST_API_TOKEN + "x"] + ([INFER_TOKEN] if needs == "api" else [])
    for token in wrong:
        _refused(client.request(method, path, headers={"authorization": f"Bearer {token}"}, content=body),
                 "invalid_token")
    # The right token: the route answers (the API token opens the inference routes too).
    for token in [TEST_API_TOKEN] + ([INFER_TOKEN] if needs == "infer" else []):
        reply = client.request(method, path, headers={"authorization": f"Bearer {token}"}, content=b"[]")
        assert reply.status_code != 401, (token, reply.text)
        assert reply.json().get("code") not in ("missing_token", "invalid_token"), reply.text


@pytest.mark.parametrize("method, path", [(m, p) for m, p in OPEN_ROUTES if "{" not in p])
def test_open_routes_need_no_token(client: TestClient, method: str, path: str) -> None:
    assert client.request(method, path).status_code != 401


def test_every_route_of_the_app_is_classified(client: TestClient) -> None:
    """The app's operations (from its OpenAPI description) are exactly the routes above."""
    def template(path: str) -> str:
        return re.sub(r"job-[0-9a-f]{12}", "{job_id}", re.sub(r"ds-[0-9a-f]{12}", "{dataset_id}", path)) \
            .replace("/versions/1/", "/versions/{version}/").replace(SESSION, "{session_id}")

    declared = {(m, template(p)) for m, p, _ in CASES} - {("POST", "/train/"), ("GET", "/weights/anything")}
    declared |= set(OPEN_ROUTES)
    paths = client.get("/openapi.json").json()["paths"]
    operations = {(method.upper(), path) for path, ops in paths.items() for method in ops}
    assert operations == declared, (sorted(operations - declared), sorted(declared - operations))
