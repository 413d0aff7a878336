"""How /classify runs its model, decided once at start-up: inline on the event loop, on a
worker thread, or through BentoML's adaptive batcher (``serve.batching``; what ``auto``
picks and why: docs/serving.md, "Adaptive batching"; the figures: docs/benchmarks.md,
Serving).

On a CPU a worker's event loop is its scarcest core: a call that costs less than the trip
to a worker thread and back (a future, a wake-up, two GIL handoffs) runs inline; a 10-20
ms call would stall every other request on the loop, so it goes to a thread. The model's
call is timed here; the trip is ``HOP_MS``, not measured at each start (below). On a GPU
one call of many images is what keeps the device busy, so there ``auto`` batches.

`bentoml serve` imports the service once in its own process before it starts the workers:
the choice made there is handed to them in the environment (``CHOICE_ENV``), so every
worker serves the same way and none races the others for the cores while it starts.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from trainyard.core.card import card_from_metadata
from trainyard.core.config import ServeParams
from trainyard.runtime.inputs import decode_image, model_input, softmax
from trainyard.runtime.sessions import CUDA, OnnxModel, load_onnx

# A call slower than this on a CPU stays off the event loop (it would stall every other
# request there) and is not batched (the model's work dominates: batching loses).
MAX_CALL_MS = 2.0
TIMED_CALLS = 5
# What a trip to a worker thread and back costs while the event loop runs other requests:
# the thread waits for the GIL, which the loop drops only for an instant at each I/O poll,
# and CPython hands it over on request only to a thread that saw no switch meanwhile. Timed
# at every start until stop 53 (a no-op's round trip beside four busy tasks), it measured
# 5.7 ms, 18.7 ms, 34.7 ms, 364 ms and 5 s on the same quiet 2 cores: 15 such trips took up
# to 75 s of `bentoml serve`'s start-up, and two starts served two different ways. 35 ms
# is the middle of those; under wrk on the Fashion CNN an inline limit from 35 ms served
# 574-658 req/s with 1 worker, from 10 ms 470-548, from 300 ms 567-689 (2 starts each).
HOP_MS = 35.0
CHOICE_ENV = "TRAINYARD_SERVE_PATH"  # the serve process's choice, for its workers

Call = Callable[[], np.ndarray]


@dataclass(frozen=True)
class ServePath:
    """How /classify runs the model: ``params.batching`` a bool; ``inline_images``, the most
    images one model call (a request's, or an adaptive batch's) may hold and still run on
    the event loop (0: every call hops to a worker thread); and why (the start-up line)."""

    params: ServeParams
    inline_images: int
    why: str

    def describe(self) -> str:
        how = "through the adaptive batcher, " if self.params.batching else ""
        if not self.inline_images:
            return f"{how}on a worker thread"
        if not self.params.batching:
            return "inline on the event loop (an upload over 64 KiB: on a worker thread)"
        return (
            f"{how}a batch of 2 to {self.inline_images} images inline on the event loop, "
            "a lone request's and larger ones on a worker thread"
        )


def choose_path(params: ServeParams, model_path: Path, sha256: str = "") -> ServePath:
    """The path for ``params`` and the model at ``model_path``. Batching: as set, or with
    ``auto`` on CUDA and for a CPU call under ``MAX_CALL_MS``. Inline: on a CPU, as many
    images per call as take less time than a thread hop with the event loop busy. A choice
    ``bentoml serve`` already made for the same model is reused."""
    key = f"{sha256}:{params.device}:{params.model_threads()}:{params.batching}"
    try:
        handed = json.loads(os.environ.get(CHOICE_ENV) or "{}")
    except ValueError:
        handed = {}
    if handed.get("key") == key:
        batching, images = bool(handed["batching"]), int(handed["inline_images"])
        why = f"{handed['why']}; the call timed once, by the serve process"
        return ServePath(params.model_copy(update={"batching": batching}), images, why)
    chosen = _measure(params, model_path)
    os.environ[CHOICE_ENV] = json.dumps(
        {
            "key": key,
            "batching": chosen.params.batching,
            "inline_images": chosen.inline_images,
            "why": chosen.why,
        }
    )
    return chosen


def _measure(params: ServeParams, model_path: Path) -> ServePath:
    model = load_onnx(model_path, params.device, params.model_threads(), say=False)
    auto = params.batching == "auto"
    if model.provider == CUDA:
        why = "on CUDA" + (": auto batches" if auto else "")
        return ServePath(
            params.model_copy(update={"batching": params.batching is not False}), 0, why
        )
    call = _one_call(model)
    for _ in range(2):  # the first call allocates and picks kernels
        call()
    # The quickest of the timed calls: other work on the cores only ever adds to a call
    # (the median of 5 moved 0.29-0.75 ms from start to start on a shared machine, and the
    # inline batch size with it, 9 to 27 images).
    ms = min(_timed(call) for _ in range(TIMED_CALLS))
    said = f"a call of one image takes {ms:.2f} ms on the CPU"
    if ms >= MAX_CALL_MS:
        why = f"{said}, over {MAX_CALL_MS:g} ms" + (": auto does not batch" if auto else "")
        return ServePath(params.model_copy(update={"batching": params.batching is True}), 0, why)
    # The hop is HOP_MS, a constant (its measures above), not timed at this start.
    why = f"{said}, a thread hop about {HOP_MS:g} ms with the event loop busy (a set figure)"
    batching = params.batching is not False  # auto: a cheap call batches
    return ServePath(params.model_copy(update={"batching": batching}), int(HOP_MS // ms), why)


def _one_call(model: OnnxModel) -> Call:
    """What /classify does with one upload of the model's own size: decode, normalise,
    infer, softmax."""
    card = card_from_metadata(model.metadata)
    c, h, w = card.input_shape
    noise = np.random.default_rng(0).integers(0, 256, (h, w, c), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise[..., 0] if c == 1 else noise).save(buf, "PNG")
    upload = buf.getvalue()

    def call() -> np.ndarray:
        pixels = decode_image(upload, card)
        return softmax(model.run(model_input(pixels[None].astype(np.float32), card)))

    return call


def _timed(call: Call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3
