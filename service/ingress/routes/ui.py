"""GET /ui/: the status page, static files only (service/ingress/static/ui: HTML, JS, CSS).

The page holds no data: the browser reads it from the API, `/gangs` (and `/gang`) without a
token, `/train*` with the API token the user types into the page once (kept in the tab's
sessionStorage). So nothing under /ui needs a token, and AuthMiddleware's rules are the
same as without the page. No CDN, no inline script or style: every file is served with a
Content-Security-Policy that allows this origin only, so the page works offline and cannot
be made to load or send anything elsewhere.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

UI_DIR = Path(__file__).resolve().parents[1] / "static" / "ui"
UI_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate (ETag): a new release's page is seen at once
}


class UIFiles(StaticFiles):
    """StaticFiles (no directory listings, no paths outside UI_DIR, no symlinks) plus UI_HEADERS."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(UI_HEADERS)
        return response


def mount_ui(app: FastAPI) -> None:
    """Serve the page at /ui/ (`/ui` redirects there); index.html for the directory."""
    app.mount("/ui", UIFiles(directory=UI_DIR, html=True), name="ui")
