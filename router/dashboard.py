"""``GET /dashboard``: the operator page, plain HTML + JS + CSS from ``router/static``.

No build step and nothing from a CDN: the page works offline. It polls ``GET /stats``
(relative URL, so it also works behind a path-prefix proxy) and draws its charts itself
(SVG). The browser keeps the history behind the sparklines; the router keeps none for it.

    install_dashboard(app)   # in create_app

``/dashboard?interval=500`` polls every 500 ms (default 1000, clamped to 200-60000).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("router")

# The page loads only its own files and talks only to this router.
_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class _Static(StaticFiles):
    """Static files with the dashboard's security headers (``no-cache`` so that an upgraded
    router never runs with a stale script)."""

    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(_HEADERS)
        return response


def install_dashboard(app: FastAPI) -> None:
    """Register ``GET /dashboard`` and its files under ``/dashboard/static``.

    The page reads everything from ``/stats``, so what it shows is exactly what the API
    reports; the dashboard needs no access to the service itself.
    """
    try:
        page: Response = HTMLResponse((STATIC / "dashboard.html").read_text(encoding="utf-8"),
                                      headers=_HEADERS)
    except FileNotFoundError:  # an install without package data: routing must still work
        log.warning("dashboard files missing in %s; GET /dashboard answers 503", STATIC)
        page = PlainTextResponse(f"dashboard files missing in {STATIC}: install the package "
                                 "with its data (router/static)", status_code=503)

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> Response:
        return page

    if STATIC.is_dir():
        app.mount("/dashboard/static", _Static(directory=STATIC), name="dashboard-static")
