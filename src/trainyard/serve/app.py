"""The routes that are not prediction endpoints, as a Starlette app the service mounts at /:
GET /metadata (for curl and the demo page; the client's is the POST api method), GET /card
(the model card, trainyard.serve.card_page), the demo
page /ui, the Swagger UI page /docs, / -> /docs, and a JSON 404/405 for any other path.

BentoML matches its own routes (the ``@bentoml.api`` methods, probes, /metrics) first; this
app answers only what they do not take, and leaves alone the paths BentoML adds after its
mounts (the OpenAPI document /docs.json and the Swagger UI files /static_content/...).
"""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Match, Route

from trainyard.serve.card_page import card
from trainyard.serve.metrics import count_refusal
from trainyard.serve.predictor import Predictor
from trainyard.serve.ui_routes import ui_routes

# Listed in a 404 after the service's api methods (POST), which the service sets on start-up.
PAGES = (
    "GET /metadata, GET /card, GET /ui, GET /docs, GET /docs.json, GET /healthz, GET /readyz, "
    "GET /livez, GET /metrics"
)
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
# Served by BentoML after its mounts: a catch-all here would shadow them.
BENTOML_PATHS, BENTOML_PREFIXES = frozenset({"/docs.json"}), ("/static_content/", "/assets/")
# BentoML's own Swagger UI files and initializer (SwaggerUIBundle({url: "./docs.json"})),
# without the tag-manager script of BentoML's index page: nothing loads from elsewhere.
DOCS_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="UTF-8">
  <title>trainyard classifier: API</title>
  <link rel="stylesheet" type="text/css" href="./static_content/swagger-ui.css">
  <link rel="icon" type="image/png" href="./static_content/favicon-light-32x32.png">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="./static_content/swagger-ui-bundle.js" charset="UTF-8"></script>
  <script src="./static_content/swagger-ui-standalone-preset.js" charset="UTF-8"></script>
  <script src="./static_content/swagger-initializer.js" charset="UTF-8"></script>
</body>
</html>
"""


def build_app() -> Starlette:
    """The routes. The service sets ``app.state.predictor`` (GET /metadata answers from
    it) and ``app.state.api_routes`` (its api methods' routes) on start-up: BentoML makes
    the service instance after the app is mounted."""
    return Starlette(
        exception_handlers={404: not_found, 405: not_found},
        routes=[
            Route("/metadata", _metadata, methods=["GET"]),
            Route("/card", card, methods=["GET"]),  # the model card (serve.card_page)
            *ui_routes(),
            Route("/docs", _docs_page, methods=["GET"]),
            Route("/", _to_docs, methods=["GET"]),
            _Elsewhere(),  # last: any other path
        ],
    )


async def _metadata(request: Request) -> JSONResponse:
    predictor: Predictor = request.app.state.predictor
    return JSONResponse(predictor.describe())


async def _docs_page(request: Request) -> Response:
    return HTMLResponse(DOCS_PAGE)


async def _to_docs(request: Request) -> Response:
    return RedirectResponse("./docs", status_code=307)


class _Elsewhere(Route):
    """Every path and method not taken before, except BentoML's later ones: a JSON 404, or
    405 for another method on a POST endpoint."""

    def __init__(self) -> None:
        super().__init__("/{path:path}", not_found, methods=ALL_METHODS)

    def matches(self, scope: dict[str, Any]) -> tuple[Match, dict[str, Any]]:
        path = scope.get("path", "")
        if path in BENTOML_PATHS or path.startswith(BENTOML_PREFIXES):
            return Match.NONE, {}
        return super().matches(scope)


async def not_found(request: Request, exc: Exception | None = None) -> JSONResponse:
    """404/405 as JSON like every other answer, with the list of what exists."""
    api_routes: frozenset[str] = getattr(request.app.state, "api_routes", frozenset())
    status = getattr(exc, "status_code", 404)
    if exc is None and request.url.path in api_routes:
        status = 405  # the endpoint exists, for POST
    count_refusal("not_found" if status == 404 else "method_not_allowed")
    endpoints = ", ".join([*(f"POST {r}" for r in sorted(api_routes)), PAGES])
    return JSONResponse(
        {
            "error": f"{request.method} {request.url.path}: "
            + ("Not Found" if status == 404 else "Method Not Allowed")
            + f"; endpoints: {endpoints}",
            "field": None,
        },
        status,
    )
