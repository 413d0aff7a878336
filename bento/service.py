"""BentoML service: any exported trainyard model over HTTP, on CUDA or CPU, refusing bad input.

    make serve          # bentoml serve bento.service:ImageClassifier on 127.0.0.1:3000
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
``serve.batching`` on, /classify is itself BentoML's batchable method: its adaptive batcher
merges concurrent requests into one ONNX Runtime run (trainyard.serve.batching).
"""

from __future__ import annotations

import logging
from typing import Any

import bentoml
from starlette.responses import Response

from trainyard.serve.api import (
    BatchForm,
    ClassifyForm,
    Prediction,
    Predictions,
    answer,
    read_batch,
    read_classify,
)
from trainyard.serve.app import build_app
from trainyard.serve.balance import balance_connections
from trainyard.serve.batching import answer_batch, batched_classify
from trainyard.serve.guard import RequestGuard
from trainyard.serve.lifecycle import freeze_heap, stop_listening_on_sigterm
from trainyard.serve.refused import Refused
from trainyard.serve.settings import service_config
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
PAGES = build_app()  # GET /metadata, /ui, /docs, / and the JSON 404 (trainyard.serve.app)


@bentoml.service(**service_config(PARAMS, ["/metrics", "/healthz", "/livez", "/readyz"]))
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
        PAGES.state.api_routes = frozenset(m.route for m in ImageClassifier.apis.values())

    @bentoml.on_startup
    def follow_the_alias(self) -> None:
        """Serving models:/NAME@ALIAS: a watcher thread swaps in each version it moves to."""
        swap = swap_into(self, PAGES.state, START.trace, START.carry_observer)
        source, provenance = SETTINGS.model_source, START.provenance
        self.watcher = watch_if_following(source, PARAMS, provenance, START.follow, swap)

    @bentoml.on_startup
    def share_connections(self) -> None:
        """Keep-alive connections spread over the workers; on SIGTERM the port stops
        listening before uvicorn drains the requests in flight."""
        balance_connections(PARAMS.workers_count(), bentoml.server_context.worker_index)
        stop_listening_on_sigterm()

    if PARAMS.batching:  # BentoML's adaptive batcher merges concurrent requests

        @bentoml.api(**batched_classify(PARAMS))
        async def classify(self, asks: list[Any]) -> list[Response]:
            """One image: a multipart file field 'image', or the whole body sent with its image
            Content-Type (image/png, image/jpeg, ...); top_k and invert as form fields or query."""
            return await answer_batch(asks)

    else:

        @bentoml.api(route="/classify", input_spec=ClassifyForm, output_spec=Prediction)
        async def classify(self, ctx: bentoml.Context) -> Response:
            """One image: a multipart file field 'image', or the whole body sent with its image
            Content-Type (image/png, image/jpeg, ...); top_k and invert as form fields or query."""
            predictor = self.predictor  # read once: a swap meanwhile leaves it its model
            try:
                ask = await read_classify(ctx.request, predictor.card, PARAMS)
                return answer(await predictor.classify(ask.image, ask.top_k, ask.invert))
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


ImageClassifier.mount_asgi_app(PAGES, path="/")
ImageClassifier.add_asgi_middleware(RequestGuard, **START.guard_options())
