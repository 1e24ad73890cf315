"""The status page's files (/ui/) through the real FastAPI app and its AuthMiddleware, in
process (no Ray): served without a token, with a same-origin-only CSP, nothing outside the
page's directory, and the token rules of every other route unchanged."""
from __future__ import annotations

import re
import warnings
from typing import Iterator

import pytest

with warnings.catch_warnings():  # starlette's note that it prefers httpx2
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from tests.conftest import TEST_API_TOKEN, local_yaml_args

pytestmark = pytest.mark.unit

AUTH = {"authorization": f"Bearer {TEST_API_TOKEN}"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    mp = pytest.MonkeyPatch()
    mp.setenv("GANGSERVE_API_TOKEN", TEST_API_TOKEN)
    mp.delenv("GANGSERVE_INFER_TOKEN", raising=False)
    from service.app import parse_args
    from service.ingress.api import create_api

    # The gang client is never reached by these requests (no /gang, /infer).
    app = create_api(parse_args(local_yaml_args()), gang=None)  # type: ignore[arg-type]
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c
    mp.undo()


def test_the_page_and_its_files_need_no_token(client: TestClient) -> None:
    page = client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>gangserve status</title>" in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    # Every file the page references is served from here (no CDN, no inline script or style).
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(not re.match(r"^[a-z]+://|^//", r) for r in refs), refs
    assert not re.search(r"<script>(?!</script>)|<style|style=", page.text)
    for ref in (r for r in refs if not r.startswith("data:")):
        reply = client.get("/ui/" + ref)
        assert reply.status_code == 200 and reply.content, ref
    assert client.get("/ui/app.js").headers["content-type"].startswith(("text/javascript", "application/javascript"))
    redirect = client.get("/ui", follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"].endswith("/ui/")  # the method kept


def test_nothing_but_the_page_is_reachable_under_ui(client: TestClient) -> None:
    for path in ("/ui/missing.js", "/ui/../ui_not_here", "/ui/%2e%2e/auth.py", "/ui/..%2fapi.py", "/ui/../../api.py"):
        reply = client.get(path)
        assert reply.status_code == 404, (path, reply.status_code, reply.text[:200])
        assert reply.json()["code"] == "not_found"


def test_token_rules_are_unchanged_by_the_page(client: TestClient) -> None:
    from service.ingress.auth import required_token

    for path in ("/ui", "/ui/", "/ui/app.js", "/ui/index.html"):
        assert required_token(path) is None, path
    # A path under /ui that names a protected route does not reach it, token or not: encoded
    # dot segments and empty segments stay paths under /ui, which serves only the page's files ...
    for path in ("/ui/%2e%2e/train", "/ui//train"):
        for headers in ({}, AUTH):
            reply = client.get(path, headers=headers)
            assert reply.status_code == 404 and reply.json()["code"] == "not_found", (path, reply.status_code)
    # ... and a literal `..` is removed by the client before it sends (RFC 3986 dot segments):
    # the request is GET /train itself, under its own token rule.
    reply = client.get("/ui/../train")
    assert reply.request.url.path == "/train"
    assert reply.status_code == 401 and reply.json()["code"] == "missing_token", reply.text
