"""The demo page at /ui: drop a photo, see the top labels (static files in serve/ui/)."""

from __future__ import annotations

from starlette.routing import BaseRoute


def ui_routes() -> list[BaseRoute]:
    """The routes that serve the demo page and its assets."""
    return []
