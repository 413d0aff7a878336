"""BentoML service: any exported trainyard model over HTTP, on CUDA or CPU, refusing bad input.

    make serve          # bentoml serve serving.service:ImageClassifier on 127.0.0.1:3000
    curl -F image=@photo.jpg http://127.0.0.1:3000/classify
    curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' 'http://127.0.0.1:3000/classify?top_k=3'
    curl -F images=@a.jpg -F images=@b.png http://127.0.0.1:3000/classify_batch
    bentoml.SyncHTTPClient("http://127.0.0.1:3000").classify(image=Path("photo.jpg"))

A request's way: the ``@bentoml.api`` method below reads it (trainyard.serve.api: bytes,
pixels, ints, or a ``Refused`` 4xx), hands that to the Predictor (trainyard.serve.predictor:
decode by the model's dataset card, ONNX Runtime, the answer) and returns the JSON. Every
knob is the ``serve`` section of params.yaml, read here once.

BentoML runs the process model (workers), the traffic limits (max concurrency, timeout),
/metrics, the probes, the OpenAPI document (/docs.json) and the bento. With
``serve.batching`` on, /classify sends each decoded image to the batchable method
``probabilities`` through the service's own in-process client (``self.to_async``), so
BentoML's adaptive batcher merges concurrent requests into one ONNX Runtime run.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import bentoml
from bentoml.exceptions import ServiceUnavailable
from starlette.responses import Response

from trainyard.serve.api import (
    BatchForm,
    ClassifyForm,
    Pixels,
    Prediction,
    Predictions,
    answer,
    read_batch,
    read_classify,
)
from trainyard.serve.app import build_app
from trainyard.serve.guard import INTERNAL_HEADER, RequestGuard
from trainyard.serve.lifecycle import freeze_heap, stop_listening_on_sigterm
from trainyard.serve.parsing import Refused, overloaded
from trainyard.serve.startup import start
from trainyard.serve.swap import swap_into, watch_if_following

# bentoml.serve's handlers are the ones `bentoml serve` prints; a child logger shares them.
log = logging.getLogger("bentoml.serve.trainyard")


def registry(name: str) -> Any:
    """trainyard.track.registry's function ``name`` (MLflow), for a models:/ source; None
    where it cannot be imported: a bento has neither MLflow nor trainyard.track."""
    try:
        from trainyard.track import registry as track_registry
    except ImportError:
        return None
    return getattr(track_registry, name)


# The model, shadow, log folder, reference and alias to follow, resolved and checked now,
# in the `bentoml serve` process itself (trainyard.serve.startup).
START = start(registry)
SETTINGS, PARAMS = START.settings, START.params
# The batchable method answers only this process's own client (the guard 404s the rest).
INTERNAL_ROUTE, INTERNAL_TOKEN = "/probabilities", secrets.token_urlsafe(24)
PAGES = build_app()  # GET /metadata, /ui, /docs, / and the JSON 404 (trainyard.serve.app)


@bentoml.service(
    name="trainyard_classifier",
    workers=PARAMS.workers,
    traffic={"timeout": PARAMS.timeout_s, "max_concurrency": PARAMS.max_concurrency},
    # The in-process client (batching): BentoML would renew its session every 100 requests
    # or 300 s, closing it under the requests still in flight (500s at 8 clients).
    runner_connection={"max_requests": 2**62, "max_age": 1e12},
    logging={
        "access": {
            "enabled": PARAMS.access_log,
            "skip_paths": ["/metrics", "/healthz", "/livez", "/readyz", INTERNAL_ROUTE],
        }
    },
)
class ImageClassifier:
    """Any trainyard model: the ONNX file the pipeline exported and verified, served by
    trainyard.serve's Predictor (one per worker)."""

    def __init__(self) -> None:
        self.predictor = START.predictor()  # with its observer: log, shadow, drift score
        freeze_heap()  # after the model: what start-up built stays for the process's life
        log.info("%s", START.startup_line(self.predictor))

    @bentoml.on_shutdown
    def close_observer(self) -> None:
        """The shadow's queue scored and the prediction log's last rows written."""
        if self.predictor.observer is not None:
            self.predictor.observer.close()

    @bentoml.on_startup
    def warm_up(self) -> None:
        """Before /readyz says ready, per worker: first decode and inference paid now."""
        self.predictor.warm_up()

    @bentoml.on_startup
    def answer_pages(self) -> None:
        """The mounted app of the other routes: GET /metadata answers from this worker's
        predictor, a 404 lists the api methods."""
        PAGES.state.predictor = self.predictor
        routes = {m.route for m in ImageClassifier.apis.values()} - {INTERNAL_ROUTE}
        PAGES.state.api_routes = frozenset(routes)

    @bentoml.on_startup
    def follow_the_alias(self) -> None:
        """Serving models:/NAME@ALIAS: a watcher thread swaps in each version it moves to."""
        swap = swap_into(self, PAGES.state, START.trace, START.carry_observer)
        source, provenance = SETTINGS.model_source, START.provenance
        self.watcher = watch_if_following(source, PARAMS, provenance, START.follow, swap)

    @bentoml.on_startup
    def refuse_connections_on_sigterm(self) -> None:
        """On SIGTERM the port stops listening before uvicorn drains the requests in flight."""
        stop_listening_on_sigterm()

    @bentoml.api(route="/classify", input_spec=ClassifyForm, output_spec=Prediction)
    async def classify(self, ctx: bentoml.Context) -> Response:
        """One image: a multipart file field 'image', or the whole body sent with its image
        Content-Type (image/png, image/jpeg, ...); top_k and invert as form fields or query."""
        predictor = self.predictor  # read once: a swap meanwhile leaves this request's model
        try:
            ask = await read_classify(ctx.request, predictor.card, PARAMS)
            if not PARAMS.batching:
                return answer(await predictor.classify(ask.image, ask.top_k, ask.invert))
            start, info = time.perf_counter(), {}
            pixels = await predictor.decode_one(ask.image, ask.invert, info)
            probs = await self._batched(pixels.tobytes())
            prediction = predictor.prediction(probs, ask.top_k)
            # The batchable method returns probabilities only: no embedding in the log.
            seen = {"pixels": pixels, "image": ask.image, "invert": ask.invert}
            predictor.observe("/classify", prediction, start, info, **seen)
            return answer(prediction)
        except Refused as err:
            return err.answer(ctx)

    @bentoml.api(route="/classify_batch", input_spec=BatchForm, output_spec=Predictions)
    async def classify_batch(self, ctx: bentoml.Context) -> Response:
        """Images as repeated multipart fields 'images', or JSON {"images": [pixel arrays
        shaped as /metadata's input.image]}; top_k and invert as form fields or query."""
        predictor = self.predictor  # read once: a swap meanwhile leaves this request's model
        try:
            ask = await read_batch(ctx.request, predictor.card, PARAMS)
            results = await predictor.classify_batch(ask.images, ask.top_k, ask.invert)
            return answer(results)
        except Refused as err:
            return err.answer(ctx)

    @bentoml.api(route="/metadata")
    def metadata(self) -> dict[str, Any]:
        """The model's identity, classes, input contract and limits (also GET /metadata)."""
        return self.predictor.describe()

    if PARAMS.batching:  # only then: BentoML's /docs.json lists every api method

        @bentoml.api(
            route=INTERNAL_ROUTE,
            input_spec=Pixels,
            batchable=True,
            max_batch_size=PARAMS.max_batch_size,
            max_latency_ms=PARAMS.max_latency_ms,
        )
        def probabilities(self, pixels: list[bytes]) -> list[list[float]]:
            """Internal: decoded images -> probabilities, on one adaptive batch."""
            return self.predictor.probabilities_of_raw(pixels).tolist()  # type: ignore[no-any-return]

    async def _batched(self, pixels: bytes) -> Any:
        """One image's probabilities through BentoML's adaptive batcher: the batchable
        method, called through the service's own in-process client."""
        client = self.to_async  # type: ignore[attr-defined]  # set by BentoML per worker
        # The client reads its headers when it opens its session, on its first call.
        client.default_headers[INTERNAL_HEADER] = INTERNAL_TOKEN
        try:
            [probs] = await client.probabilities(pixels=[pixels])
        except ServiceUnavailable:  # the batcher shed it: not answerable in max_latency_ms
            raise overloaded(PARAMS.max_latency_ms) from None
        return probs


ImageClassifier.mount_asgi_app(PAGES, path="/")
ImageClassifier.add_asgi_middleware(
    RequestGuard,
    api_key=SETTINGS.api_key,
    max_body_bytes=PARAMS.max_body_bytes,
    trace_headers=START.trace,
    max_header_bytes=PARAMS.max_header_bytes,
    body_timeout_s=PARAMS.body_timeout_s,
    header_timeout_s=PARAMS.header_timeout_s,
    internal_paths=frozenset({INTERNAL_ROUTE}),
    internal_token=INTERNAL_TOKEN,
)
