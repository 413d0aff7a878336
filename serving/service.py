"""BentoML service: any exported trainyard model over HTTP, on CUDA or CPU, refusing bad input.

    make serve          # bentoml serve serving.service:ImageClassifier on 127.0.0.1:3000
    curl -F image=@photo.jpg http://127.0.0.1:3000/classify
    curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' 'http://127.0.0.1:3000/classify?top_k=3'
    curl -F images=@a.jpg -F images=@b.png http://127.0.0.1:3000/classify_batch

This file is the BentoML declaration and the reading of settings, nothing else: the routes,
the request guard, parsing and the classifier are trainyard.serve (importable, and tested,
without a server). Everything the model needs to know about its input is the dataset card
in the ONNX metadata; the knobs are the ``serve`` section of params.yaml.

BentoML runs the process model (workers), the traffic limits (max concurrency, timeout),
/metrics, the probes and the bento, and its own adaptive batcher (``CorkDispatcher``)
merges concurrent /classify requests into one ONNX Runtime run, fed the decoded pixels in
process instead of through BentoML's in-process HTTP client.
"""

from __future__ import annotations

import logging
from pathlib import Path

import bentoml

from trainyard.runtime.sessions import choose_providers
from trainyard.serve.app import build_app
from trainyard.serve.guard import RequestGuard
from trainyard.serve.lifecycle import freeze_heap, stop_listening_on_sigterm
from trainyard.serve.predictor import Predictor
from trainyard.serve.settings import (
    model_provenance,
    read_settings,
    registry_unavailable,
    resolve_model,
    trace_headers,
    verify_model,
)

# bentoml.serve's handlers are the ones `bentoml serve` prints; a child logger shares them.
log = logging.getLogger("bentoml.serve.trainyard")


def fetch_registered(uri: str, cache: Path) -> tuple[Path, dict[str, str]]:
    """A ``models:/`` URI through MLflow's registry, downloaded to ``cache`` and checked
    against the version's recorded sha256. Imported here, only for such a URI: the
    development environment has MLflow; a bento has neither it nor trainyard.track."""
    try:
        from trainyard.track.registry import fetch_registered_onnx
    except ImportError as err:
        raise registry_unavailable(uri, err) from None
    return fetch_registered_onnx(uri, cache)


SETTINGS = read_settings()
PARAMS = SETTINGS.params
MODEL_PATH, _SOURCE = resolve_model(SETTINGS, fetch_registered)
# Checked on import, i.e. in the `bentoml serve` (or `bentoml build`) process itself: a
# missing or altered model, an unknown registry model or alias, or a 'cuda' that cannot be
# had, stops the command with this message instead of leaving workers failing and
# respawning behind an unready port.
MODEL_SHA256 = verify_model(MODEL_PATH)
choose_providers(PARAMS.device)
PROVENANCE = model_provenance(MODEL_PATH, _SOURCE)


@bentoml.service(
    name="trainyard_classifier",
    workers=PARAMS.workers,
    traffic={"timeout": PARAMS.timeout_s, "max_concurrency": PARAMS.max_concurrency},
    logging={
        "access": {
            "enabled": PARAMS.access_log,
            "skip_paths": ["/metrics", "/healthz", "/livez", "/readyz"],
        }
    },
)
class ImageClassifier:
    """Any trainyard model: the ONNX file the pipeline exported and verified, served by
    trainyard.serve's Predictor (one per worker)."""

    def __init__(self) -> None:
        self.predictor = Predictor.load(MODEL_PATH, PARAMS, PROVENANCE)
        freeze_heap()  # after the model: what start-up built stays for the process's life
        log.info("%s", self.predictor.startup_message(SETTINGS.params_file))

    @bentoml.on_startup
    def warm_up(self) -> None:
        """Before /readyz says ready, per worker: first decode and inference paid now."""
        self.predictor.warm_up()

    @bentoml.on_startup
    def refuse_connections_on_sigterm(self) -> None:
        """On SIGTERM the port stops listening before uvicorn drains the requests in flight."""
        stop_listening_on_sigterm()


def _current_predictor() -> Predictor:
    # The worker's service instance, which BentoML makes after this module is imported.
    return bentoml.get_current_service().predictor  # type: ignore[no-any-return]


ImageClassifier.mount_asgi_app(build_app(_current_predictor), path="/")
ImageClassifier.add_asgi_middleware(
    RequestGuard,
    api_key=SETTINGS.api_key,
    max_body_bytes=PARAMS.max_body_bytes,
    trace_headers=trace_headers(MODEL_SHA256, PROVENANCE),
    max_header_bytes=PARAMS.max_header_bytes,
    body_timeout_s=PARAMS.body_timeout_s,
    header_timeout_s=PARAMS.header_timeout_s,
)
