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

import functools
from collections.abc import Callable
from importlib.resources import files
from typing import Any

from quart import Quart, Response, jsonify, request
from werkzeug.datastructures import MIMEAccept
from werkzeug.exceptions import NotFound
from werkzeug.http import parse_accept_header

#: The files under ``/page/``, with their types.
ASSETS = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8",
          "statechart.svg": "image/svg+xml", "icon.svg": "image/svg+xml"}
#: Their paths: public (:func:`mlxcel.http.auth.is_public`), as ``/`` is; nothing else under ``/page/`` is.
PUBLIC_FILES = frozenset(f"/page/{name}" for name in ASSETS)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
#: Every answer of the page's; ``Vary``: ``/`` answers the page or the JSON index by ``Accept``.
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache", "Vary": "Accept"}


def announce(urls: list[str]) -> str:
    """The line ``mlxcel serve`` logs once listening: where a browser finds the page (a wildcard address
    given as this host's loopback, which a browser on it can open)."""
    first = urls[0].replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    return f"the page: open {first}/ in a browser (the MTP policy and the server, live)"


@functools.cache
def _read(name: str) -> bytes:
    return files(__name__).joinpath(name).read_bytes()


def prefers_html(accept: str | None) -> bool:
    """Whether an ``Accept`` header prefers HTML to JSON (a browser's does; ``*/*`` and none do not)."""
    parsed = parse_accept_header(accept, MIMEAccept)
    return parsed.quality("text/html") > parsed.quality("application/json") and "text/html" in parsed.values()


def answer(path: str, accept: str | None) -> tuple[bytes, str] | None:
    """The page's answer to ``GET path`` (its body and type), or None where *path* is not the page's (``/``
    asked for by anything but a browser included)."""
    if path == "/" and prefers_html(accept):
        return _read("index.html"), "text/html; charset=utf-8"
    if path in PUBLIC_FILES:
        name = path.removeprefix("/page/")
        return _read(name), ASSETS[name]
    return None


async def send_answer(send: Callable[[dict[str, Any]], Any], found: tuple[bytes, str]) -> None:
    """*found* (:func:`answer`) as an ASGI response: for a front that answers without an app (a server of several
    models serves the page itself, so that showing it never loads a model)."""
    body, kind = found
    headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode()),
               *((name.lower().encode(), value.encode()) for name, value in HEADERS.items())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def register(app: Quart, index: Callable[[], dict[str, Any]]) -> None:
    """``GET /`` (the page, or *index*'s JSON) and ``GET /page/<name>`` on *app*."""

    @app.get("/")
    async def front() -> Response:
        found = answer("/", request.headers.get("Accept"))
        if found is None:
            response = jsonify(index())
            response.headers["Vary"] = "Accept"
            return response
        return Response(found[0], content_type=found[1], headers=HEADERS)

    @app.get("/page/<name>")
    async def asset(name: str) -> Response:
        found = answer(f"/page/{name}", None)
        if found is None:
            raise NotFound()  # answered as every 404 is (mlxcel.http.app)
        return Response(found[0], content_type=found[1], headers=HEADERS)
