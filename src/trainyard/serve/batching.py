"""/classify on BentoML's adaptive batcher, in one call per batch (``serve.batching: true``;
what it does for a client, and its figures: docs/serving.md, "Adaptive batching").

With batching on, /classify itself is the ``batchable=True`` api method. BentoML reads each
request with the input descriptor below (``BatchedClassifyForm``: the same reading as the
unbatched route, ``read_classify``, into a one-item list), its CorkDispatcher merges the
lists of concurrent requests, and the method answers the merged list in one call, on the
event loop or in one trip to a worker thread (trainyard.serve.batch_choice decides which).
BentoML splits the answers back, and the output descriptor (``BatchedPrediction``) hands
each request its own response, a 200 or its ``Refused`` 4xx. An explaining request
(``explain=1``) is merged like any other: the batch's one run then asks for the class
activation maps too (a batch of plain requests never does). A request the batcher sheds
gets BentoML's generic 503 before any method of ours runs; the request guard turns it into
the service's own (trainyard.serve.startup's ``guard_options``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import bentoml
import numpy as np
from bentoml.exceptions import ServiceUnavailable
from pydantic import ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from trainyard.core.config import ServeParams
from trainyard.serve.api import ClassifyForm, Prediction, answer, read_classify
from trainyard.serve.predictor import SMALL_UPLOAD_BYTES, Predictor
from trainyard.serve.refused import Refused

BENTOML_ERRORS = "bentoml._internal.server.http_app"  # its log_exception's logger


@dataclass(frozen=True)
class Queued:
    """One /classify request, read and decoded, waiting for its batch: with the predictor
    that decoded it (a swap meanwhile leaves it its model)."""

    pixels: np.ndarray | None  # uint8 [C,H,W] by the predictor's card; None: decoded with the batch
    top_k: int
    predictor: Predictor
    start: float
    info: dict[str, Any]  # the upload's format, width and height (for the prediction log)
    image: bytes
    invert: bool
    explain: bool = False  # the answer gets its heatmap


class Asked(bentoml.IODescriptor):
    """A request as the batchable method takes it: a list of one ``Queued`` or ``Refused``
    (BentoML's batcher concatenates the lists of concurrent requests)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    asks: list[Any]


class BatchedClassifyForm(ClassifyForm):
    """/classify's fields for BentoML's document and client, as unbatched. Each request is
    read here, before the batcher, so a bad one never waits for a batch; a large upload (a
    photo: milliseconds to decode) is decoded here too, on a thread of its own, so the
    decodes of the next batch overlap this one's model call. A small one (a few KB) is
    decoded with its batch: its own thread trip would cost more than its decode. An
    explaining request to a model without maps is refused here."""

    @classmethod
    async def from_http_request(cls, request: Request, serde: Any) -> bentoml.IODescriptor:
        predictor: Predictor = bentoml.get_current_service().predictor
        start, info = time.perf_counter(), {}
        item: Queued | Refused
        try:
            ask = await read_classify(request, predictor.card, predictor.params)
            if ask.explain:
                predictor.check_explainable()
            pixels = None
            if len(ask.image) > SMALL_UPLOAD_BYTES:  # decoded as it arrives
                pixels = await predictor.decode_one(ask.image, ask.invert, info)
            item = Queued(
                pixels, ask.top_k, predictor, start, info, ask.image, ask.invert, ask.explain
            )
        except Refused as err:
            item = err
        return Asked.model_construct(asks=[item])  # built by us: nothing to validate


class BatchedPrediction(Prediction, bentoml.IODescriptor):
    """/classify's answer: a Prediction, or the request's Refused as ``{"error", "field"}``."""

    model_config = ConfigDict(title="Prediction")

    @classmethod
    async def to_http_response(cls, obj: Any, serde: Any) -> Response:
        [response] = obj  # the batcher's split: this request's share, one response
        return response  # type: ignore[no-any-return]


async def answer_batch(items: Sequence[Queued | Refused]) -> list[Response]:
    """The merged requests' responses, in order: the refused ones at once, the others in
    one call per predictor (two only while a swap is under way): on the event loop for a
    merged batch small enough (``Predictor.inline_images``), else in one worker-thread trip."""
    responses: list[Response | None] = [None] * len(items)
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        if isinstance(item, Refused):
            responses[i] = item.response()
        else:
            groups.setdefault(id(item.predictor), []).append(i)
    for members in groups.values():
        queued: list[Queued] = [items[i] for i in members]  # type: ignore[misc]
        predictor = queued[0].predictor
        # Here when cheaper than a thread's round trip; a batch of one still hops, so that
        # the requests arriving meanwhile gather into the next batch (BentoML's batcher
        # waits for none when the last batches went out at once, alone).
        if 2 <= len(queued) <= predictor.inline_images:
            answered = _answer_all(queued)
        else:
            answered = await predictor.in_thread(_answer_all, queued)
        for i, response in zip(members, answered, strict=True):
            responses[i] = response
    return responses  # type: ignore[return-value]


def _answer_all(queued: Sequence[Queued]) -> list[Response]:
    """On the worker thread: the small uploads decoded, one model call, and the JSON of
    every answer (its encoding too: the event loop is the service's scarcest core). An
    image that is no image is its own request's 4xx, not the batch's."""
    predictor = queued[0].predictor
    responses: list[Response | None] = [None] * len(queued)
    pixels, kept = [], []
    for i, q in enumerate(queued):
        try:
            decoded = q.pixels
            if decoded is None:
                decoded = predictor.decode(q.image, "image", q.invert, q.info)
        except Refused as err:
            responses[i] = err.response()
            continue
        pixels.append(decoded)
        kept.append(i)
    if kept:
        answers = predictor.classify_decoded(pixels, [queued[i] for i in kept])
        for i, answered in zip(kept, answers, strict=True):
            responses[i] = answer(answered)
    return responses  # type: ignore[return-value]


class _ShedIsNoError(logging.Filter):
    """BentoML logs each request its batcher sheds as an ERROR with a traceback; it is
    answered (503, Retry-After) and counted on /metrics (refused, reason overloaded)."""

    def filter(self, record: logging.LogRecord) -> bool:
        shed = record.exc_info is not None and isinstance(record.exc_info[1], ServiceUnavailable)
        return not shed


def batched_classify(params: ServeParams) -> dict[str, Any]:
    """``@bentoml.api``'s arguments for the batchable /classify (and BentoML's error log
    told that a shed request is no error)."""
    logging.getLogger(BENTOML_ERRORS).addFilter(_ShedIsNoError())
    return {
        "route": "/classify",
        "input_spec": BatchedClassifyForm,
        "output_spec": BatchedPrediction,
        "batchable": True,
        "max_batch_size": params.max_batch_size,
        "max_latency_ms": params.max_latency_ms,
    }
