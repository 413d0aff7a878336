"""The service's OpenAPI document (/docs.json) and its interactive page (/docs)."""

from __future__ import annotations

from starlette.routing import BaseRoute


def openapi_routes() -> list[BaseRoute]:
    """The routes that serve the OpenAPI document and Swagger UI."""
    return []
