"""The demo page at /ui: drop a photo, see the top labels (static files in serve/ui/).

Three small files, no build step and no CDN: the page calls the service's own JSON API
(GET /metadata, POST /classify) with relative URLs, so it works behind a path prefix too.
They are read once, when the routes are made, so a bento missing them fails at start-up
rather than on the first visit. The guard leaves /ui and /ui/... open without the API key;
the page asks for the key when /metadata answers 401 and sends it as a Bearer token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

# name -> content type; the only files served (no directory listing, no path from the URL).
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "ui.js": "text/javascript; charset=utf-8",
    "ui.css": "text/css; charset=utf-8",
}
# The browser itself refuses anything but this origin, so the page cannot grow a CDN link.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' blob: data:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
    ),
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}


def read_asset(name: str) -> bytes:
    """One of the page's files, from the installed package (or the bento's copy)."""
    return files("trainyard.serve").joinpath("ui", name).read_bytes()


def ui_routes() -> list[BaseRoute]:
    """The routes that serve the demo page and its assets."""
    routes: list[BaseRoute] = [
        Route(
            "/ui" if name == "index.html" else f"/ui/{name}",
            _static(read_asset(name), media_type),
            methods=["GET"],
        )
        for name, media_type in ASSETS.items()
    ]
    # /ui/ would resolve the page's relative URLs one level too deep: send it to /ui.
    routes.append(Route("/ui/", _to_page, methods=["GET"]))
    return routes


def _static(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

    return serve


async def _to_page(request: Request) -> Response:
    return RedirectResponse("../ui", status_code=308)
