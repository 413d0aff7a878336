"""BentoML service: any exported trainyard model over HTTP, on CUDA or CPU, refusing bad input.

    make serve          # bentoml serve bento.service:ImageClassifier on 127.0.0.1:3000
    curl -F image=@photo.jpg http://127.0.0.1:3000/classify
    curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' 'http://127.0.0.1:3000/classify?top_k=3'
    curl -F images=@a.jpg -F images=@b.png http://127.0.0.1:3000/classify_batch

A request: read by trainyard.serve.api (or a ``Refused`` 4xx), answered by the Predictor
(trainyard.serve.predictor: the model's dataset card, ONNX Runtime). Every knob is
params.yaml's ``serve`` section. BentoML runs the workers, traffic limits, /metrics, the
probes, /docs.json, the bento, and with ``serve.batching`` its batcher (serve.batching).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import bentoml
from starlette.responses import Response

from trainyard.core.model_ref import ModelRegistry
from trainyard.serve.api import (
    BatchForm,
    ClassifyForm,
    Prediction,
    Predictions,
    classify_many,
    classify_one,
)
from trainyard.serve.app import build_app
from trainyard.serve.balance import balance_connections
from trainyard.serve.batching import answer_batch, batched_classify
from trainyard.serve.guard import RequestGuard
from trainyard.serve.lifecycle import bind_api_methods, freeze_heap, stop_listening_on_sigterm
from trainyard.serve.settings import service_config
from trainyard.serve.startup import start

# bentoml.serve's handlers are the ones `bentoml serve` prints; a child logger shares them.
log = logging.getLogger("bentoml.serve.trainyard")


def mlflow_registry() -> ModelRegistry | None:
    """MLflow's model registry, loaded only for a models:/ or runs:/ source; None where it
    cannot be imported: a bento has neither MLflow nor trainyard.track."""
    try:
        from trainyard.track.model_refs import MlflowRegistry
    except ImportError:
        return None
    # MLflow draws a tqdm bar per download (model, reference; each worker, each swap): in a
    # server's log, lines of carriage returns. Off, unless the environment asks for them.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return MlflowRegistry()


# Model, shadow, log folder, reference, alias: checked now, in `bentoml serve` (startup).
START = start(mlflow_registry)
PARAMS = START.params
PAGES = build_app()  # GET /metadata, /ui, /docs, / and the JSON 404 (trainyard.serve.app)


@bentoml.service(**service_config(PARAMS, ["/metrics", "/healthz", "/livez", "/readyz"]))
class ImageClassifier:
    """The ONNX file the pipeline exported and verified; one Predictor per worker."""

    def __init__(self) -> None:
        self.predictor = START.predictor()  # with its observer: log, shadow, drift score
        bind_api_methods(self)  # built once, not per request (serve.lifecycle)
        log.info("%s", START.startup_line(self.predictor))

    @bentoml.on_shutdown
    def close_observer(self) -> None:
        """The shadow's queue scored and the prediction log's last rows written."""
        if self.predictor.observer is not None:
            self.predictor.observer.close()

    @bentoml.on_startup
    def warm_up(self) -> None:
        """Before /readyz says ready, per worker: first decode and inference paid now; then
        what start-up built (BentoML's app too) is frozen for the process's life."""
        self.predictor.warm_up()
        freeze_heap()

    @bentoml.on_startup
    def join_the_pool(self) -> None:
        """The pages answer from this predictor (GET /metadata, the 404's routes); a watcher
        swaps in each version models:/NAME@ALIAS moves to; connections spread over workers,
        and on SIGTERM the port stops listening before uvicorn drains what is in flight."""
        PAGES.state.predictor = self.predictor
        PAGES.state.api_routes = frozenset(m.route for m in ImageClassifier.apis.values())
        self.watcher = START.watch(self, PAGES.state)
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
            return await classify_one(ctx, self.predictor, PARAMS)  # read once: a swap waits

    @bentoml.api(route="/classify_batch", input_spec=BatchForm, output_spec=Predictions)
    async def classify_batch(self, ctx: bentoml.Context) -> Response:
        """Images as repeated multipart fields 'images', or JSON {"images": [pixel arrays
        shaped as /metadata's input.image]}; top_k and invert as form fields or query."""
        return await classify_many(ctx, self.predictor, PARAMS)

    @bentoml.api(route="/metadata")
    def metadata(self) -> dict[str, Any]:
        """The model's identity, classes, input contract and limits (also GET /metadata)."""
        return self.predictor.describe()


ImageClassifier.mount_asgi_app(PAGES, path="/")
ImageClassifier.add_asgi_middleware(RequestGuard, **START.guard_options())
