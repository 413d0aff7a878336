"""Plain BentoML services: what BentoML itself costs a request, beside the bare servers.

The same model and answer as ``reference_server``'s inline design, on the event loop, one
worker, access log off (the bare servers run uvicorn with ``--no-access-log``); none of
trainyard's guard, batching, prediction log or metrics:

- ``PlainClassifier``: as BentoML's documentation writes a service, one async
  ``@bentoml.api`` with a typed ``PIL.Image`` input (BentoML reads the multipart field and
  opens the image), BentoML's defaults otherwise;
- ``LeanClassifier``: every per-request cost removed that can be without changing BentoML:
  the request left unread for the method (an ``IODescriptor`` without fields that reads
  nothing, as the service's own), tracing's middleware told to skip every URL, the api
  method's caller built once and the start-up heap frozen (the service's own two start-up
  measures, trainyard.serve.lifecycle), the request metrics off, the answer a Starlette
  response (BentoML otherwise builds the output type's JSON schema for every response, to
  name its media type), the image decoded as the bare servers decode it. What is left is
  BentoML's fixed cost a request.

Not for deployment.

    TRAINYARD_MODEL=models/model.onnx bentoml serve benchmarks.reference_bento:PlainClassifier
"""

from __future__ import annotations

from typing import Any

import bentoml
import numpy as np
from PIL.Image import Image
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from benchmarks.reference_server import CARD, answer_for, answer_pixels
from trainyard.serve.lifecycle import bind_api_methods, freeze_heap

QUIET = {"access": {"enabled": False}}


@bentoml.service(logging=QUIET)
class PlainClassifier:
    @bentoml.api
    async def classify(self, image: Image) -> dict:
        """POST /classify: the prediction for the multipart ``image`` upload."""
        mode = "L" if CARD.channels == 1 else "RGB"
        pixels = np.asarray(image.convert(mode).resize((CARD.width, CARD.height)))
        return answer_pixels(pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1))


class Answer(BaseModel):
    """The answer's fields, for BentoML's document (the method sends a Response)."""

    label: str
    class_id: int
    probabilities: list[float]


class _Unread(bentoml.IODescriptor):
    """No fields, and the request left unread: the method reads it from ``ctx``."""

    @classmethod
    async def from_http_request(cls, request: Request, serde: Any) -> bentoml.IODescriptor:
        return cls()


@bentoml.service(logging=QUIET, tracing={"excluded_urls": [".*"]}, metrics={"enabled": False})
class LeanClassifier:
    def __init__(self) -> None:
        bind_api_methods(self)

    @bentoml.on_startup
    def freeze(self) -> None:
        """Start-up over: its heap out of the garbage collector's sight, as the service's."""
        freeze_heap()

    @bentoml.api(input_spec=_Unread, output_spec=Answer)
    async def classify(self, ctx: bentoml.Context) -> Response:
        """POST /classify: the same answer, the upload read and decoded as the bare servers
        do, answered as a Response (BentoML sends it as it is)."""
        form = await ctx.request.form()
        return JSONResponse(answer_for(await form["image"].read()))  # type: ignore[union-attr]
