"""GET /card: the served model's card (evaluate's ``model.card.md`` / ``model.card.json``,
beside the model file: the bento ships them), Markdown by default and JSON when asked.

JSON when the query says ``?format=json``, or without ``format`` when the Accept header
prefers ``application/json`` to ``text/markdown`` (by q); ``?format=md`` is Markdown whatever
the header. The file is read on each request from beside the model answering now, so a swap to
another registry version serves that version's card. A model without one (exported before
cards, or a registry version downloaded without it) is a 404 saying so.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trainyard.runtime.model_file import card_beside
from trainyard.serve.metrics import count_refusal

MEDIA_TYPES = {"json": "application/json", "md": "text/markdown; charset=utf-8"}
FORMATS = {"json": "json", "md": "md", "markdown": "md"}
NO_CARD = "no card for this model"


def card_format(query: str | None, accept: str) -> str | None:
    """``json`` or ``md`` from ``?format=`` (None: not a format) or else the Accept header:
    of application/json and text/markdown (or text/plain), the one with the higher q, the
    first named on a tie; Markdown when it names neither (a browser's text/html, */*)."""
    if query is not None:
        return FORMATS.get(query.strip().lower())
    best, best_q = "md", 0.0
    for part in accept.split(","):
        media, *options = (p.strip().lower() for p in part.split(";"))
        kind = {"application/json": "json", "text/markdown": "md", "text/plain": "md"}.get(media)
        q = next((_q(o[2:]) for o in options if o.startswith("q=")), 1.0)
        if kind is not None and q > best_q:
            best, best_q = kind, q
    return best


def _q(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_card(model: Path, kind: str) -> bytes | None:
    """The card of ``model`` as ``kind``, or None when there is none beside it."""
    try:
        return card_beside(model, kind).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None


async def card(request: Request) -> Response:
    """GET /card for the service's predictor (``request.app.state.predictor``)."""
    kind = card_format(request.query_params.get("format"), request.headers.get("accept", ""))
    if kind is None:
        count_refusal("bad_request")
        return JSONResponse(
            {"error": "format: expected json or md (markdown)", "field": "format"}, 400
        )
    model: Path = request.app.state.predictor.model_path
    body = read_card(model, kind)
    if body is None:
        count_refusal("not_found")
        return JSONResponse(
            {
                "error": f"{NO_CARD}: {card_beside(model, kind).name} is not beside "
                f"{model.name} (evaluate writes it: `dvc repro evaluate`, then rebuild the "
                "bento)",
                "field": None,
            },
            404,
        )
    return Response(body, media_type=MEDIA_TYPES[kind])
