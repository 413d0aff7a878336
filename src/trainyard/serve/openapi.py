"""The service's OpenAPI document (/docs.json) and its interactive page (/docs).

The routes are Starlette routes, not ``@bentoml.api`` methods, so BentoML's generated
document knows nothing of them; this one is written here, as a dict, from what the routes
really take: the limits (max batch images, top_k, body size) and the model's contract
(classes, input shape, image formats) are read from the live /metadata document, i.e. the
worker's ServeParams and dataset card, on every request.

Swagger UI is BentoML's own offline copy (its ``static_content`` folder), served here at
/static_content: the app's catch-all 404 route would otherwise answer those paths before
BentoML's own mount sees them. No CDN, no inline script.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from trainyard import __version__
from trainyard.runtime.inputs import IMAGE_FORMATS
from trainyard.serve.parsing import MAX_TOP_K_DIGITS
from trainyard.serve.predictor import Predictor

Doc = dict[str, Any]
TOP_K_MAX = 10**MAX_TOP_K_DIGITS - 1
# Every format the service decodes; HEIF's photos are usually sent as image/heic (iPhone).
IMAGE_TYPES = (*(f"image/{fmt.lower()}" for fmt in IMAGE_FORMATS), "image/heic")
PROBES = {
    "/healthz": "Liveness (BentoML): 200 while the process runs.",
    "/livez": "Liveness (BentoML): 200 while the process runs.",
    "/readyz": "Readiness (BentoML): 200 once every worker has loaded and warmed the model.",
    "/metrics": "Prometheus metrics (BentoML's and trainyard's request/refusal counters).",
}
ERRORS = {
    400: "Bad request: the message names the field at fault and says what to send instead.",
    401: "Missing or wrong API key (only when the service has one): send "
    "'Authorization: Bearer <key>'.",
    408: "The body was not received whole within serve.body_timeout_s (a slow client).",
    413: "Too large: body over serve.max_body_bytes, an image over serve.max_image_pixels, "
    "or more images than serve.max_batch_images.",
    415: "Unsupported Content-Type for this route (or a pickle body, always refused).",
    431: "Request line and headers over serve.max_header_bytes.",
    429: "Too many requests in flight (serve.max_concurrency); retry shortly.",
    503: "Overloaded (adaptive batching could not answer within serve.max_latency_ms; "
    "Retry-After: 1) or not ready yet.",
    504: "The request took longer than serve.timeout_s.",
}
PAGE = """<!DOCTYPE html>
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
  <!-- BentoML's initializer: SwaggerUIBundle({url: "./docs.json", ...}) -->
  <script src="./static_content/swagger-initializer.js" charset="UTF-8"></script>
</body>
</html>
"""


def swagger_assets() -> Path:
    """BentoML's bundled Swagger UI files (found without importing BentoML)."""
    spec = importlib.util.find_spec("bentoml")
    if spec is None or spec.origin is None:
        raise RuntimeError("BentoML is not installed: no Swagger UI assets to serve")
    return Path(spec.origin).parent / "_internal" / "server" / "static_content"


def openapi_routes(predictor: Callable[[], Predictor]) -> list[BaseRoute]:
    """GET /docs.json (the document), /docs (Swagger UI), /static_content/* (its files),
    and / -> /docs (where BentoML's own index page, Swagger UI, would be).

    ``predictor`` (the worker's, looked up per request) gives the limits and contract."""

    async def document(request: Request) -> Response:
        return JSONResponse(openapi_document(predictor().describe()))

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def home(request: Request) -> Response:
        return RedirectResponse("./docs", status_code=307)

    return [
        Route("/docs.json", document, methods=["GET"], name="openapi"),
        Route("/docs", page, methods=["GET"], name="swagger_ui"),
        Route("/", home, methods=["GET"], name="home"),
        Mount("/static_content", StaticFiles(directory=swagger_assets()), name="static_content"),
    ]


# ---------------------------------------------------------------------------- the document


def openapi_document(meta: Mapping[str, Any]) -> Doc:
    """OpenAPI 3.0 for the routes, from the /metadata document ``meta`` (the worker's
    ServeParams limits under ``input``, the model's classes and input shape)."""
    classes = list(meta["classes"])
    inp = meta["input"]
    version = meta["model"]["version"]
    paths: Doc = {
        "/classify": {"post": _classify(inp, classes)},
        "/classify_batch": {"post": _classify_batch(inp, classes)},
        "/metadata": {"get": _metadata()},
    }
    paths.update({path: {"get": _probe(path, text)} for path, text in PROBES.items()})
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "trainyard classifier",
            "version": __version__,
            "description": (
                f"Image classification with model {version} ({len(classes)} classes: "
                f"{', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''}), "
                f"input {inp['image']} ({inp['resize']}). Images in any of "
                f"{', '.join(IMAGE_FORMATS)}, any size up to {inp['max_image_pixels']:,} "
                f"pixels; request bodies up to {inp['max_body_bytes']:,} bytes. Every error "
                'is JSON {"error": message, "field": the field at fault or null}.'
            ),
        },
        "tags": [
            {"name": "classify", "description": "The model"},
            {"name": "probes", "description": "BentoML's health and metrics endpoints"},
        ],
        "paths": paths,
        "components": {
            "schemas": _schemas(inp, classes),
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Only when the service runs with $TRAINYARD_API_KEY.",
                }
            },
        },
    }


def _query(inp: Mapping[str, Any], n_classes: int, invert: str) -> list[Doc]:
    default = min(int(inp["top_k"]), n_classes)
    return [
        {
            "name": "top_k",
            "in": "query",
            "required": False,
            "description": (
                f"How many classes to list in top_k, best first (default {default}; "
                f"a number over {n_classes} lists all {n_classes})."
            ),
            "schema": {
                "type": "integer",
                "minimum": 1,
                "maximum": TOP_K_MAX,
                "default": default,
            },
        },
        {
            "name": "invert",
            "in": "query",
            "required": False,
            "description": invert + " Also 1/0, yes/no, on/off; absent or empty is false.",
            "schema": {"type": "boolean", "default": False},
        },
    ]


def _errors(*statuses: int) -> Doc:
    ref = {"$ref": "#/components/schemas/Error"}
    return {
        str(s): {"description": ERRORS[s], "content": {"application/json": {"schema": ref}}}
        for s in statuses
    }


def _ok(description: str, schema: Doc) -> Doc:
    return {
        "200": {"description": description, "content": {"application/json": {"schema": schema}}}
    }


def _classify(inp: Mapping[str, Any], classes: list[str]) -> Doc:
    binary = {"type": "string", "format": "binary"}
    form = {
        "type": "object",
        "required": ["image"],
        "additionalProperties": False,
        "properties": {
            "image": {**binary, "description": "The image file."},
            "top_k": {
                "type": "integer",
                "minimum": 1,
                "maximum": TOP_K_MAX,
                "description": "As the query's.",
            },
            "invert": {"type": "boolean", "description": "As the query's."},
        },
    }
    raw = {**binary, "description": "The image file itself as the body."}
    return {
        "tags": ["classify"],
        "operationId": "classify",
        "summary": "Classify one image",
        "description": (
            "One image, as the multipart file field `image` (curl -F image=@photo.jpg) or as "
            "the whole body with its image Content-Type (curl --data-binary @photo.jpg -H "
            f"'Content-Type: image/jpeg'). Decoded, converted and resized to {inp['image']} "
            "exactly as in training."
        ),
        "parameters": _query(
            inp, len(classes), "Invert the image (light objects on dark, as in MNIST)."
        ),
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": form,
                    "encoding": {"image": {"contentType": ", ".join(IMAGE_TYPES)}},
                },
                **{media: {"schema": raw} for media in IMAGE_TYPES},
            },
        },
        "responses": {
            **_ok("The prediction.", {"$ref": "#/components/schemas/Prediction"}),
            **_errors(400, 401, 408, 413, 415, 429, 431, 503, 504),
        },
        "security": [{"apiKey": []}, {}],
    }


def _classify_batch(inp: Mapping[str, Any], classes: list[str]) -> Doc:
    limit = int(inp["max_batch_images"])
    files = {
        "type": "array",
        "minItems": 1,
        "maxItems": limit,
        "items": {"type": "string", "format": "binary"},
        "description": f"1 to {limit} image files, one field each.",
    }
    form = {
        "type": "object",
        "required": ["images"],
        "additionalProperties": False,
        "properties": {
            "images": files,
            "invert": {"type": "boolean", "description": "As the query's."},
        },
    }
    body = {
        "type": "object",
        "required": ["images"],
        "additionalProperties": False,
        "properties": {
            "images": {
                "type": "array",
                "minItems": 1,
                "maxItems": limit,
                "items": {"$ref": "#/components/schemas/Pixels"},
                "description": f"1 to {limit} images of pixels 0-255, each {inp['image']}.",
            }
        },
    }
    return {
        "tags": ["classify"],
        "operationId": "classify_batch",
        "summary": "Classify several images",
        "description": (
            "Image files as repeated multipart fields `images` (curl -F images=@a.jpg -F "
            f"images=@b.png), or JSON pixel arrays already {inp['image']}: "
            f'{{"images": [...]}}. At most {limit} images (serve.max_batch_images). '
            "Answers one prediction per image, in order."
        ),
        "parameters": _query(inp, len(classes), "Invert the image files (not JSON pixels)."),
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": form,
                    "encoding": {"images": {"contentType": ", ".join(IMAGE_TYPES)}},
                },
                "application/json": {"schema": body},
            },
        },
        "responses": {
            **_ok(
                "One prediction per image, in order.",
                {"type": "array", "items": {"$ref": "#/components/schemas/Prediction"}},
            ),
            **_errors(400, 401, 408, 413, 415, 429, 431, 503, 504),
        },
        "security": [{"apiKey": []}, {}],
    }


def _metadata() -> Doc:
    return {
        "tags": ["classify"],
        "operationId": "metadata",
        "summary": "The model, its input contract and the serving limits",
        "responses": {
            **_ok("What is served, and how.", {"$ref": "#/components/schemas/Metadata"}),
            **_errors(401, 429, 431, 504),
        },
        "security": [{"apiKey": []}, {}],
    }


def _probe(path: str, description: str) -> Doc:
    text = {"text/plain": {"schema": {"type": "string"}}}
    responses: Doc = {"200": {"description": "OK", "content": text}}
    if path == "/readyz":
        responses["503"] = {"description": "Not ready yet.", "content": text}
    return {
        "tags": ["probes"],
        "operationId": path.strip("/"),
        "summary": description,
        "security": [],
        "responses": responses,
    }


def _schemas(inp: Mapping[str, Any], classes: list[str]) -> Doc:
    _, c, h, w = inp["shape"]
    row = {
        "type": "array",
        "minItems": w,
        "maxItems": w,
        "items": {"type": "number", "minimum": 0, "maximum": 255},
    }
    pixels: Doc = {"type": "array", "minItems": h, "maxItems": h, "items": row}
    if c != 1:
        pixels = {"type": "array", "minItems": c, "maxItems": c, "items": pixels}
    label = {"type": "string", "enum": classes}
    class_id = {"type": "integer", "minimum": 0, "maximum": len(classes) - 1}
    probability = {"type": "number", "minimum": 0, "maximum": 1}
    ranked = {
        "type": "object",
        "required": ["label", "class_id", "probability"],
        "properties": {"label": label, "class_id": class_id, "probability": probability},
    }
    n = len(classes)
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {"type": "string", "description": "What is wrong and what to send."},
                "field": {
                    "type": "string",
                    "nullable": True,
                    "description": "The field at fault (e.g. image, images[2][0][1], top_k, "
                    "Content-Type, body), or null.",
                },
            },
        },
        "Pixels": {
            **pixels,
            "description": f"One image {inp['image']} (channels first), numbers 0-255.",
        },
        "Prediction": {
            "type": "object",
            "required": ["label", "class_id", "probabilities", "top_k", "model_version"],
            "properties": {
                "label": label,
                "class_id": class_id,
                "probabilities": {
                    "type": "array",
                    "minItems": n,
                    "maxItems": n,
                    "items": probability,
                    "description": "One per class, in class_id order; they sum to 1.",
                },
                "top_k": {"type": "array", "minItems": 1, "maxItems": n, "items": ranked},
                "model_version": {"type": "string", "description": "sha256[:12] of the model."},
            },
        },
        "Metadata": _metadata_schema(),
    }


def _metadata_schema() -> Doc:
    obj = {"type": "object"}
    keys = ("model", "classes", "dataset_card", "input", "endpoints", "source")
    keys += ("provider", "io_binding", "device", "threads", "batching")
    return {
        "type": "object",
        "required": list(keys),
        "properties": {
            "model": {
                "type": "object",
                "required": ["path", "sha256", "version"],
                "properties": {
                    "path": {"type": "string"},
                    "sha256": {"type": "string"},
                    "version": {"type": "string"},
                },
            },
            "classes": {"type": "array", "items": {"type": "string"}},
            "dataset_card": obj,
            "input": {
                "type": "object",
                "description": "shape, image, normalization, resize, image_formats and the "
                "limits: max_image_pixels, max_batch_images, max_body_bytes, top_k.",
            },
            "endpoints": obj,
            "source": obj,
            "provider": {"type": "string"},
            "io_binding": {
                "type": "boolean",
                "description": "Whether inputs and outputs are bound on the device (CUDA).",
            },
            "device": {"type": "string"},
            "threads": obj,
            "batching": obj,
        },
    }
