"""The endpoints' HTTP edge: what each one takes and answers, as BentoML is told (its
/schema.json, /docs.json and ``bentoml.SyncHTTPClient`` read these models), and the reading
of a request into the plain inputs the Predictor takes (bytes, pixel arrays, ints, bools).

Why ``from_http_request`` reads nothing: BentoML's own parsing would write each upload to a
temporary file, fetch any URL sent as text in a file field, take no raw image body
(``Content-Type: image/png``), and answer its errors in its own shape. So the api method
reads the request itself, with ``read_classify`` / ``read_batch`` below (trainyard's
parsing: every refusal a ``Refused`` 4xx naming the field), from ``ctx.request``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import anyio.to_thread
import bentoml
import numpy as np
from bentoml.validators import ContentType
from pydantic import BaseModel, Field, RootModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trainyard.core.card import Card
from trainyard.core.config import ServeParams
from trainyard.serve.parsing import (
    BATCH_USAGE,
    CLASSIFY_USAGE,
    check_count,
    file_fields,
    form_text,
    json_pixels,
    media_type,
    parse_flag,
    parse_form,
    parse_top_k,
    unsupported,
)
from trainyard.serve.refused import Refused

ImageFile = Annotated[Path, ContentType("image/*")]  # a file field to BentoML's client


# ---------------------------------------------------------------------------- what BentoML shows


class _Unread(bentoml.IODescriptor):
    """No fields: the api method gets only ``ctx`` and reads the request itself."""


_UNREAD = _Unread()  # immutable and empty: one for every request


class _RequestSpec(bentoml.IODescriptor):
    """An endpoint's fields, for BentoML's document and client; its request is left unread
    (BentoML passes the fields of what this returns to the method: none)."""

    @classmethod
    async def from_http_request(cls, request: Request, serde: Any) -> bentoml.IODescriptor:
        return _UNREAD


class ClassifyForm(_RequestSpec):
    """POST /classify: one image as the multipart file field ``image``, or as the whole body
    with its image Content-Type (image/png, image/jpeg, ... image/heic); ``top_k``,
    ``invert`` and ``explain`` as form fields or query parameters."""

    image: ImageFile = Field(description="the image (any format Pillow decodes)")
    top_k: int | None = Field(None, ge=1, description="labels to list; default serve.top_k")
    invert: bool = Field(False, description="invert the image first (dark object on white)")
    explain: bool = Field(
        False,
        description="add `heatmap`: where in the image the top class was seen (a base64 PNG "
        "the size of the upload); a model exported without its `cam` output answers 400",
    )


class BatchForm(_RequestSpec):
    """POST /classify_batch: the files as repeated multipart fields ``images``, or JSON
    ``{"images": [arrays of 0-255 numbers shaped as GET /metadata input.image]}``."""

    images: list[ImageFile] = Field(description="the images, in order")
    top_k: int | None = Field(None, ge=1, description="labels to list; default serve.top_k")
    invert: bool = Field(False, description="invert every image first")


class Ranked(BaseModel):
    label: str
    class_id: int
    probability: float


class Prediction(BaseModel):
    """One image's answer: the top-1 label, every class's probability, the top ``top_k``."""

    label: str
    class_id: int
    probabilities: list[float]
    top_k: list[Ranked]
    model_version: str = Field(description="the first 12 hex digits of the model's sha256")
    heatmap: str | None = Field(
        None,
        description="only with explain: where the model looked for its top class, a PNG of "
        "the upload's width and height, base64-encoded: coloured (jet) and opaque where "
        "the class's activation map is high, transparent where it is 0 (an indexed PNG "
        "with alpha, RGBA to a browser), to lay on the image",
    )


class Predictions(RootModel[list[Prediction]]):
    """/classify_batch's answer: one Prediction per image, in the order sent."""


# ---------------------------------------------------------------------------- what the method reads


@dataclass(frozen=True)
class OneImage:
    """A /classify request, read: the image's bytes and the options."""

    image: bytes
    top_k: int
    invert: bool
    explain: bool = False


@dataclass(frozen=True)
class ImageBatch:
    """A /classify_batch request, read: encoded images, or pixels [N,C,H,W] from JSON."""

    images: list[bytes] | np.ndarray
    top_k: int
    invert: bool


async def read_classify(request: Request, card: Card, params: ServeParams) -> OneImage:
    """The image, top_k and invert of a /classify request, or a Refused 4xx."""
    body = await request.body()
    _require_body(body, CLASSIFY_USAGE)
    media, query = media_type(request.headers), request.query_params
    n = len(card.classes)
    if media.startswith("image/"):
        image = body
        invert = parse_flag("invert", query.get("invert"))
        explain = parse_flag("explain", query.get("explain"))
        top_k = parse_top_k(query.get("top_k"), n, params.top_k)
    elif media == "multipart/form-data":
        images, top_k, invert, explain = await _read_form(
            request, body, "image", 1, CLASSIFY_USAGE, n, params
        )
        if len(images) != 1:
            raise Refused(
                400,
                f"image: expected one file field 'image', got {len(images)}; {CLASSIFY_USAGE}",
                field="image",
                reason="bad_field",
            )
        image = images[0]
    else:
        raise unsupported("/classify", media, CLASSIFY_USAGE)
    if not image:
        raise Refused(
            400,
            f"image: the image is empty (0 bytes); {CLASSIFY_USAGE}",
            field="image",
            reason="bad_image",
        )
    return OneImage(image, top_k, invert, explain)


async def read_batch(request: Request, card: Card, params: ServeParams) -> ImageBatch:
    """The images (files, or JSON pixels checked against the card), top_k and invert of a
    /classify_batch request, or a Refused 4xx."""
    body = await request.body()
    _require_body(body, BATCH_USAGE)
    media, query = media_type(request.headers), request.query_params
    n, limit = len(card.classes), params.max_batch_images
    if parse_flag("explain", query.get("explain")):
        raise Refused(
            400,
            "explain: /classify_batch does not explain its answers; send each image to "
            "/classify?explain=1",
            field="explain",
            reason="bad_field",
        )
    if media == "multipart/form-data":
        files, top_k, invert, _ = await _read_form(
            request, body, "images", limit, BATCH_USAGE, n, params
        )
        check_count(len(files), limit)
        for i, data in enumerate(files):
            if not data:
                where = f"images[{i}]"
                raise Refused(
                    400, f"{where}: the image is empty (0 bytes)", field=where, reason="bad_image"
                )
        return ImageBatch(files, top_k, invert)
    if media == "application/json":
        top_k = parse_top_k(query.get("top_k"), n, params.top_k)  # before the body's parse
        pixels = await anyio.to_thread.run_sync(json_pixels, body, card, limit, params)
        return ImageBatch(pixels, top_k, invert=False)  # pixels as sent: nothing to invert
    raise unsupported("/classify_batch", media, BATCH_USAGE)


async def _read_form(
    request: Request,
    body: bytes,
    field: str,
    max_files: int,
    usage: str,
    n_classes: int,
    params: ServeParams,
) -> tuple[list[bytes], int, bool, bool]:
    """A multipart body's files under ``field``, with top_k, invert and (/classify's only:
    an ``explain`` field of a batch is unknown) explain from the form or the query string
    (the form wins), or a Refused 4xx."""
    query = request.query_params
    texts = ("invert", "top_k", "explain") if field == "image" else ("invert", "top_k")
    form = await parse_form(
        request, body, files=field, texts=texts, max_files=max_files, usage=usage
    )
    try:
        files = await file_fields(form, field, usage)
        invert = parse_flag("invert", form_text(form, "invert") or query.get("invert"))
        explain = parse_flag("explain", form_text(form, "explain") or query.get("explain"))
        top_k = parse_top_k(form_text(form, "top_k") or query.get("top_k"), n_classes, params.top_k)
    finally:
        await form.close()
    return files, top_k, invert, explain


def _require_body(body: bytes, usage: str) -> None:
    if not body:
        raise Refused(400, f"empty request body; {usage}", field="body", reason="bad_request")


def answer(result: Any) -> JSONResponse:
    """A prediction (or a list of them) as the 200 JSON answer."""
    return JSONResponse(result)


async def classify_one(ctx: bentoml.Context, predictor: Any, params: ServeParams) -> Response:
    """/classify without batching, on ``predictor`` (the service's, read once per request:
    a swap meanwhile leaves this request its model); a Refused is its own 4xx answer."""
    try:
        ask = await read_classify(ctx.request, predictor.card, params)
        if ask.explain:
            predictor.check_explainable()  # before the image is decoded
        return answer(await predictor.classify(ask.image, ask.top_k, ask.invert, ask.explain))
    except Refused as err:
        return err.answer(ctx)


async def classify_many(ctx: bentoml.Context, predictor: Any, params: ServeParams) -> Response:
    """/classify_batch on ``predictor`` (read once per request, as ``classify_one``)."""
    try:
        ask = await read_batch(ctx.request, predictor.card, params)
        return answer(await predictor.classify_batch(ask.images, ask.top_k, ask.invert))
    except Refused as err:
        return err.answer(ctx)
