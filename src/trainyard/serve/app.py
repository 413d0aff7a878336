"""The service's own routes, as a Starlette app the BentoML service mounts at /.

Why Starlette routes rather than ``@bentoml.api`` methods: a file input there is parsed by
BentoML's IO layer, written to a temporary file and validated again, and a raw image body
(``Content-Type: image/png``) cannot be expressed at all. Measured (docs/benchmarks.md,
Serving) that layer cost more than the model. These routes parse each body once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from trainyard.serve.metrics import count_refusal
from trainyard.serve.openapi import openapi_routes
from trainyard.serve.parsing import BATCH_USAGE, CLASSIFY_USAGE, Refused
from trainyard.serve.predictor import Predictor
from trainyard.serve.ui import ui_routes

ENDPOINTS = (
    "POST /classify, POST /classify_batch, GET /metadata, GET /ui, GET /docs, GET /docs.json, "
    "GET /healthz, GET /readyz, GET /livez, GET /metrics"
)
Handler = Callable[[Request], Awaitable[JSONResponse]]


def build_app(predictor: Callable[[], Predictor]) -> Starlette:
    """The routes, answering with ``predictor()`` (the current worker's, looked up per
    request: BentoML makes the service instance after the app is mounted)."""

    async def metadata(request: Request) -> JSONResponse:
        return JSONResponse(predictor().describe())

    return Starlette(
        exception_handlers={404: not_found, 405: not_found},
        routes=[
            Route("/classify", _endpoint(predictor, "classify"), methods=["POST"]),
            Route("/classify_batch", _endpoint(predictor, "classify_batch"), methods=["POST"]),
            Route("/metadata", metadata, methods=["GET"]),
            *ui_routes(),
            *openapi_routes(predictor),
            # Last: any other path. The mount sees only what BentoML's own routes did not
            # take, and Starlette's default 404 there is plain text.
            Route("/{path:path}", not_found, methods=["GET", "HEAD", "POST", "PUT", "DELETE"]),
        ],
    )


def _endpoint(predictor: Callable[[], Predictor], name: str) -> Handler:
    """A POST route calling ``predictor().<name>(request, body)``; Refused -> its JSON."""

    async def handle(request: Request) -> JSONResponse:
        try:
            body = await request.body()
            if not body:
                usage = CLASSIFY_USAGE if name == "classify" else BATCH_USAGE
                raise Refused(
                    400, f"empty request body; {usage}", field="body", reason="bad_request"
                )
            result = await getattr(predictor(), name)(request, body)
        except Refused as err:
            return err.response()
        return JSONResponse(result)

    handle.__name__ = name
    return handle


async def not_found(request: Request, exc: Exception | None = None) -> JSONResponse:
    """404/405 as JSON like every other answer, with the list of what exists."""
    status = getattr(exc, "status_code", 404)
    count_refusal("not_found" if status == 404 else "method_not_allowed")
    return JSONResponse(
        {
            "error": f"{request.method} {request.url.path}: "
            + ("Not Found" if status == 404 else "Method Not Allowed")
            + f"; endpoints: {ENDPOINTS}",
            "field": None,
        },
        status,
    )
