"""Bare Starlette + ONNX Runtime servers: the yardsticks `make bench-serve` holds BentoML to.

Same model, same preprocessing (trainyard.runtime.inputs), same ORT session options, none
of the service's guards, batching or metrics: what the HTTP stack and the model cost with
nothing else. Two designs, as a person would write them:

- ``app``: the decode and the model call on a worker thread (``run_in_threadpool``), as one
  writes it for a model that takes milliseconds;
- ``inline_app``: both on the event loop, as one writes it for a model that takes a
  fraction of a millisecond (the Fashion CNN): no thread hop, the fastest plain design there.

Not for deployment.

    TRAINYARD_MODEL=models/model.onnx uvicorn benchmarks.reference_server:app --port 3001
    TRAINYARD_MODEL=models/model.onnx uvicorn benchmarks.reference_server:inline_app --port 3002
"""

from __future__ import annotations

import os

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from trainyard.core.card import card_from_metadata
from trainyard.runtime.inputs import decode_image, model_input, softmax
from trainyard.runtime.sessions import load_onnx

MODEL = load_onnx(
    os.environ.get("TRAINYARD_MODEL", "models/model.onnx"),
    device="cpu",
    intra_op_threads=int(os.environ.get("TRAINYARD_ORT_THREADS", "1")),
)
CARD = card_from_metadata(MODEL.metadata)
CLASSES = MODEL.classes


def answer_for(data: bytes) -> dict:
    """The answer to one upload's bytes: decoded by the card, then ``answer_pixels``."""
    return answer_pixels(decode_image(data, CARD))


def answer_pixels(pixels: np.ndarray) -> dict:
    """The answer to one image's uint8 [C,H,W] pixels: the top label, every probability."""
    probs = softmax(MODEL.run(model_input(pixels[None], CARD)))[0]
    i = int(probs.argmax())
    return {"label": CLASSES[i], "class_id": i, "probabilities": probs.tolist()}


async def _upload(request: Request) -> bytes:
    form = await request.form()
    return await form["image"].read()  # type: ignore[union-attr]


async def classify(request: Request) -> JSONResponse:
    """POST /classify: the prediction for the multipart ``image`` upload, on a thread."""
    data = await _upload(request)
    return JSONResponse(await run_in_threadpool(answer_for, data))


async def classify_inline(request: Request) -> JSONResponse:
    """POST /classify: the same, decoded and scored on the event loop."""
    return JSONResponse(answer_for(await _upload(request)))


async def readyz(request: Request) -> JSONResponse:
    """Ready once the module, and so the model, has loaded."""
    return JSONResponse({"ok": True})


app = Starlette(routes=[Route("/classify", classify, methods=["POST"]), Route("/readyz", readyz)])
inline_app = Starlette(
    routes=[Route("/classify", classify_inline, methods=["POST"]), Route("/readyz", readyz)]
)
