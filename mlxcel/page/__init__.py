"""The page at ``GET /``: the MTP policy as a live picture, and what the server is doing, for a person.

Three static files and the statechart's SVG (generated: :mod:`mlxcel.policy.statechart_svg`), read once from
the package; no build step, nothing fetched from elsewhere. The page carries no data: its script polls the JSON
endpoints (``/health``, ``/v1/internal/mtp-policy``, ``/v1/internal/server-status``, ``/v1/cache/stats``,
``/v1/models``; a router's ``/router/stats``) through the API-key gate like any client, so the page and its
files are public (:data:`mlxcel.http.auth.PUBLIC_PREFIXES`) and show nothing those endpoints do not.

``GET /`` answers the page to a browser (its ``Accept`` prefers HTML) and the JSON index to everything else
(``curl``, SDKs), as before. Every file goes with a Content-Security-Policy that lets the page load its own
script, stylesheet and data and nothing else: no inline script or style, no other origin, no framing.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from typing import Any

from quart import Quart, Response, request
from werkzeug.exceptions import NotFound

#: The files under ``/page/``, with their types.
ASSETS = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8",
          "statechart.svg": "image/svg+xml", "icon.svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def announce(urls: list[str]) -> str:
    """The line ``mlxcel serve`` logs once listening: where a browser finds the page (a wildcard address
    given as this host's loopback, which a browser on it can open)."""
    first = urls[0].replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    return f"the page: open {first}/ in a browser (the MTP policy and the server, live)"


def _read(name: str) -> bytes:
    return files(__name__).joinpath(name).read_bytes()


def wants_page() -> bool:
    """Whether this request's ``Accept`` prefers HTML to JSON (a browser's does; ``*/*`` does not)."""
    accept = request.accept_mimetypes
    return accept.quality("text/html") > accept.quality("application/json") and "text/html" in accept.values()


def register(app: Quart, index: Callable[[], dict[str, Any]]) -> None:
    """``GET /`` (the page, or *index*'s JSON) and ``GET /page/<name>`` on *app*."""
    page = _read("index.html")
    assets = {name: _read(name) for name in ASSETS}

    @app.get("/")
    async def front() -> Any:
        if wants_page():
            return Response(page, content_type="text/html; charset=utf-8", headers=HEADERS)
        return index()

    @app.get("/page/<name>")
    async def asset(name: str) -> Response:
        if name not in assets:
            raise NotFound()  # answered as every 404 is (mlxcel.http.app)
        return Response(assets[name], content_type=ASSETS[name], headers=HEADERS)
