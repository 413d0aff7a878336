"""BentoML service: any exported trainyard model over HTTP, on CUDA or CPU, refusing bad input.

    make serve          # bentoml serve serving.service:ImageClassifier on 127.0.0.1:3000
    curl -F image=@photo.jpg http://127.0.0.1:3000/classify
    curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' 'http://127.0.0.1:3000/classify?top_k=3'
    curl -F images=@a.jpg -F images=@b.png http://127.0.0.1:3000/classify_batch

Everything the model needs to know about its input (channels, size, resize policy,
normalisation, class names) is the dataset card in the ONNX metadata; the knobs are the
``serve`` section of params.yaml.

Why the prediction endpoints are Starlette routes inside the BentoML service rather than
``@bentoml.api`` methods: a file input there is parsed by BentoML's IO layer, written to a
temporary file and validated again, and a raw image body (``Content-Type: image/png``)
cannot be expressed at all. Measured (docs/benchmarks.md, Serving) that layer cost more
than the model. The routes parse each body once; BentoML still runs the process model
(workers), the traffic limits (max concurrency, timeout), /metrics, the probes and the
bento, and its own adaptive batcher (``CorkDispatcher``) merges concurrent /classify
requests into one ONNX Runtime run, fed the decoded pixels in process instead of through
BentoML's in-process HTTP client, which would serialise every image to JSON.
"""

from __future__ import annotations

import gc
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import bentoml
import numpy as np
from starlette.applications import Starlette
from starlette.datastructures import FormData, Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from trainyard.core.card import card_from_metadata
from trainyard.core.config import ServeParams, load_params
from trainyard.core.errors import InputError, ModelError
from trainyard.core.io import sha256_file
from trainyard.runtime.inputs import (
    IMAGE_FORMATS,
    decode_image,
    image_shape_text,
    normalize,
    pixel_arrays,
    softmax,
)
from trainyard.runtime.sessions import OnnxModel, choose_providers, load_onnx
from trainyard.track.registry import fetch_registered_onnx

# bentoml.serve's handlers are the ones `bentoml serve` prints; a child logger shares them.
log = logging.getLogger("bentoml.serve.trainyard")

PARAMS_ENV, MODEL_ENV, API_KEY_ENV = "TRAINYARD_PARAMS", "TRAINYARD_MODEL", "TRAINYARD_API_KEY"
CACHE_ENV = "TRAINYARD_MODEL_CACHE"


def read_settings() -> tuple[ServeParams, Path, Path, dict[str, str]]:
    """(serve params, params file, model path, provenance).

    The model source is $TRAINYARD_MODEL or serve.model: a local path (relative to the
    params file's folder) or a registry URI, ``models:/NAME@ALIAS`` / ``models:/NAME/N``,
    resolved now (MLFLOW_TRACKING_URI or the embedded store), downloaded to
    $TRAINYARD_MODEL_CACHE (default ``.cache/registry`` beside the params file) and
    checked against the version's recorded sha256. Only the .onnx file is used.
    """
    params_path = Path(os.environ.get(PARAMS_ENV) or "params.yaml").resolve()
    params = load_params(params_path).serve
    source = os.environ.get(MODEL_ENV) or params.model
    if source.startswith("models:/"):
        cache = Path(os.environ.get(CACHE_ENV) or params_path.parent / ".cache" / "registry")
        model, provenance = fetch_registered_onnx(source, cache)
        return params, params_path, model, provenance
    model = Path(source)
    if not model.is_absolute():
        model = params_path.parent / model
    return params, params_path, model, {"model_source": str(model)}


def model_provenance(path: Path, provenance: dict[str, str]) -> dict[str, str]:
    """Where the served model came from: registry version (if any), run, data version."""
    # ONNX Runtime reads the metadata itself: the deployed bento needs no `onnx` package.
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    meta = dict(session.get_modelmeta().custom_metadata_map)
    del session
    return {
        "model_source": provenance.get("model_source", str(path)),
        "registry_model": provenance.get("registry_model", ""),
        "registry_version": provenance.get("registry_version", ""),
        "registry_alias": provenance.get("registry_alias", ""),
        "mlflow_run_id": provenance.get("run_id") or meta.get("mlflow_run_id", ""),
        "data_version": provenance.get("data_version") or meta.get("data_sha256", ""),
    }


def verify_model(path: Path) -> str:
    """sha256 of ``path`` after checking it against the ``<path>.sha256`` the export wrote."""
    sums = path.with_name(path.name + ".sha256")
    if not path.is_file():
        raise ModelError(
            f"{path}: model not found; run `make run` (or `dvc repro export`), "
            f"or point ${MODEL_ENV} at an exported model"
        )
    try:
        recorded = sums.read_text().split()[0].lower()
    except FileNotFoundError:
        raise ModelError(
            f"{sums}: checksum file missing; the export stage writes it beside the model, "
            "and the service only serves a model whose sha256 was recorded"
        ) from None
    except (OSError, UnicodeDecodeError, IndexError) as err:
        raise ModelError(f"{sums}: unreadable checksum file ({err!r})") from None
    try:
        actual = sha256_file(path)
    except OSError as err:
        raise ModelError(f"{path}: cannot read the model ({err})") from None
    if actual != recorded:
        raise ModelError(
            f"{path}: sha256 {actual} does not match {recorded} recorded in {sums.name}; "
            "the file changed after export. Re-export it (`dvc repro export`) rather than "
            "serve an unverified model"
        )
    return actual


def load_model(path: Path, params: ServeParams) -> tuple[OnnxModel, str]:
    """Verify, then open on the provider params ask for (a 'cuda' that cannot be had is a
    ProviderError, never a quiet CPU run)."""
    sha = verify_model(path)
    try:
        model = load_onnx(path, device=params.device, intra_op_threads=params.model_threads())
    except (OSError, RuntimeError) as err:  # onnxruntime's load failures (InvalidGraph, ...)
        raise ModelError(f"{path}: ONNX Runtime cannot load it: {err}") from None
    return model, sha


SETTINGS, PARAMS_FILE, MODEL_PATH, _SOURCE = read_settings()
# Checked on import, i.e. in the `bentoml serve` (or `bentoml build`) process itself: a
# missing or altered model, an unknown registry model or alias, or a 'cuda' that cannot be
# had, stops the command with this message instead of leaving workers failing and
# respawning behind an unready port.
MODEL_SHA256 = verify_model(MODEL_PATH)
choose_providers(SETTINGS.device)
PROVENANCE = model_provenance(MODEL_PATH, _SOURCE)
# Every response names the model that answered, so any prediction traces back to its
# registry version, MLflow run and data version.
TRACE_HEADERS = [
    (b"x-model-version", MODEL_SHA256[:12].encode()),
    (
        b"x-model-registry-version",
        (
            f"{PROVENANCE['registry_model']}/{PROVENANCE['registry_version']}"
            if PROVENANCE["registry_version"]
            else "local"
        ).encode(),
    ),
    (b"x-mlflow-run-id", PROVENANCE["mlflow_run_id"].encode()),
    (b"x-data-version", PROVENANCE["data_version"].encode()),
]


# ---------------------------------------------------------------------------- monitoring

# bentoml.metrics, not prometheus_client: BentoML sets up the multiprocess registry that
# merges every worker's series into its /metrics, beside its own request series.
PREDICTIONS = bentoml.metrics.Counter(
    name="trainyard_predictions",
    documentation="Images classified, by predicted class (top-1 label)",
    labelnames=["label"],
)
CONFIDENCE = bentoml.metrics.Histogram(
    name="trainyard_top1_confidence",
    documentation="Top-1 softmax probability of each prediction (drift: it falls)",
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
)
REFUSED = bentoml.metrics.Counter(
    name="trainyard_requests_refused",
    documentation="Requests answered 4xx/503 by the service, by reason",
    labelnames=["reason"],
)
IMAGE_PIXELS = bentoml.metrics.Histogram(
    name="trainyard_input_image_pixels",
    documentation="Width x height of each uploaded image, before any resize",
    buckets=(1e3, 1e4, 5e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8),
)
BATCH_SIZE = bentoml.metrics.Histogram(
    name="trainyard_batch_size",
    documentation="Images per ONNX Runtime run (adaptive batches and /classify_batch)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
)


# ---------------------------------------------------------------------------- request guard

# Reachable without the API key (probes, metrics, the docs UI); everything else needs it.
OPEN_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/metrics", "/", "/docs.json"})
OPEN_PREFIXES = ("/static_content/", "/assets/")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class RequestGuard:
    """Pure ASGI middleware in front of every route, BentoML's and ours.

    - API key (when set): ``Authorization: Bearer <key>``, constant-time compare, 401 else;
    - ``application/vnd.bentoml+pickle`` -> 415 on every route (never unpickle a request);
    - a POST body over ``max_body_bytes`` -> 413, read no further (Content-Length or
      counted), else handed on whole, so no route ever holds more than the limit.
    """

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_trace_headers(send)
        path, method = scope["path"], scope["method"]
        headers = Headers(scope=scope)
        is_open = method in ("GET", "HEAD") and (
            path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        )
        if self.api_key is not None and not is_open and not _authorized(headers, self.api_key):
            await _error(
                send,
                scope,
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                field="Authorization",
                reason="unauthorized",
                extra_headers={"www-authenticate": 'Bearer realm="trainyard"'},
            )
            return
        if method != "POST":
            await self.app(scope, receive, send)
            return
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media == "application/vnd.bentoml+pickle":
            await _error(
                send,
                scope,
                415,
                "pickle request bodies are refused; send JSON, multipart or an image",
                field="Content-Type",
                reason="unsupported_media_type",
            )
            return
        body = await self._read_body(scope, receive, send, headers)
        if body is None:
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers
    ) -> bytes | None:
        """The whole body, or None after answering 413/400 (over the limit, bad length)."""
        limit = self.max_body_bytes
        too_big = f"request body over {limit:,} bytes (serve.max_body_bytes)"
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await _error(
                    send,
                    scope,
                    400,
                    "Content-Length is not a number",
                    field="body",
                    reason="bad_request",
                )
                return None
            if int(declared) > limit:
                await _error(send, scope, 413, too_big, field="body", reason="body_too_large")
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:  # chunked upload that never declared its length
                await _error(send, scope, 413, too_big, field="body", reason="body_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _with_trace_headers(send: Send) -> Send:
    async def traced(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *TRACE_HEADERS]
        await send(message)

    return traced


def _authorized(headers: Headers, key: bytes) -> bool:
    scheme, _, credential = headers.get("authorization", "").partition(" ")
    given = credential.strip().encode("latin-1")  # Headers decoded latin-1: the exact bytes
    # compare_digest even when the scheme is wrong: the time taken says nothing.
    return hmac.compare_digest(given, key) and scheme.lower() == "bearer"


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the app the body already read, then the real stream's end."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _error(
    send: Send,
    scope: Scope,
    status: int,
    message: str,
    *,
    field: str | None,
    reason: str,
    extra_headers: dict[str, str] | None = None,
) -> None:
    REFUSED.labels(reason=reason).inc()
    response = JSONResponse({"error": message, "field": field}, status, extra_headers)

    async def no_body() -> Message:  # the response never reads the request
        return {"type": "http.disconnect"}

    await response(scope, no_body, send)


# ---------------------------------------------------------------------------- requests


class Refused(Exception):
    """A 4xx/503 answer: the message names the field and says what to send instead."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None,
        reason: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.field, self.reason, self.headers = status, field, reason, headers

    @classmethod
    def from_input(cls, err: InputError, reason: str) -> Refused:
        return cls(err.status, str(err), field=err.field, reason=reason)

    def response(self) -> JSONResponse:
        REFUSED.labels(reason=self.reason).inc()
        return JSONResponse({"error": str(self), "field": self.field}, self.status, self.headers)


CLASSIFY_USAGE = (
    "send one image as a multipart file field 'image' (curl -F image=@photo.jpg URL/classify) "
    "or as the whole body with its image content type "
    "(curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' URL/classify)"
)
BATCH_USAGE = (
    "send image files as repeated multipart fields 'images' "
    "(curl -F images=@a.jpg -F images=@b.png URL/classify_batch), or JSON "
    '{"images": [arrays of 0–255 numbers shaped as GET /metadata input.image]}'
)
TRUE, FALSE = frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off", ""})


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _unsupported(path: str, media: str, usage: str) -> Refused:
    got = f"'{media}'" if media else "a body without a Content-Type"
    return Refused(
        415,
        f"{path} does not take {got}; {usage}",
        field="Content-Type",
        reason="unsupported_media_type",
    )


def _flag(name: str, value: str | None) -> bool:
    text = (value or "").strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise Refused(
        400, f"{name}: expected true or false, got {value!r}", field=name, reason="bad_field"
    )


def _top_k(value: str | None, num_classes: int, default: int) -> int:
    if value is None:
        return min(default, num_classes)
    if not value.strip().isdigit() or int(value) < 1:
        raise Refused(
            400,
            f"top_k: expected a whole number from 1 to {num_classes}, got {value!r}",
            field="top_k",
            reason="bad_field",
        )
    return min(int(value), num_classes)


async def _parse_form(
    request: Request,
    body: bytes,
    *,
    files: str,
    texts: tuple[str, ...],
    max_files: int,
    usage: str,
) -> FormData:
    """The multipart body, parsed once; unknown fields, text where a file belongs and a
    file where text belongs are 400s that name the field (a text ``image`` is never taken
    for a URL to fetch)."""

    async def stream() -> Any:
        yield body

    try:
        # One more file than allowed is parsed, so "too many" is a 413 that says how many.
        form = await MultiPartParser(
            request.headers, stream(), max_files=max_files + 1, max_fields=len(texts) + 1
        ).parse()
    except MultiPartException as err:
        if err.message.startswith("Too many files"):
            if files == "image":
                raise Refused(
                    400,
                    f"image: expected one file field 'image', got more; {usage}",
                    field="image",
                    reason="bad_field",
                ) from None
            raise Refused(
                413,
                f"{files}: more than the limit of {max_files} per request "
                "(serve.max_batch_images); split them over several requests",
                field=files,
                reason="too_many_images",
            ) from None
        if err.message.startswith("Too many fields"):
            raise Refused(
                400, f"body: too many text fields; {usage}", field="body", reason="bad_field"
            ) from None
        raise Refused(
            400,
            f"body: malformed multipart/form-data ({err.message}); {usage}",
            field="body",
            reason="bad_request",
        ) from None
    for key in form:
        if key != files and key not in texts:
            await form.close()
            raise Refused(400, f"{key}: unknown form field; {usage}", field=key, reason="bad_field")
    for key in texts:
        if any(isinstance(v, UploadFile) for v in form.getlist(key)):
            await form.close()
            raise Refused(400, f"{key}: must be text, not a file", field=key, reason="bad_field")
    return form


async def _file_fields(form: FormData, name: str, usage: str) -> list[bytes]:
    out = []
    for i, value in enumerate(form.getlist(name)):
        if not isinstance(value, UploadFile):
            where = name if name == "image" else f"{name}[{i}]"
            raise Refused(
                400,
                f"{where}: must be a file upload, not text; {usage}",
                field=where,
                reason="bad_field",
            )
        out.append(await value.read())
    return out


# ---------------------------------------------------------------------------- service


@bentoml.service(
    name="trainyard_classifier",
    workers=SETTINGS.workers,
    traffic={"timeout": SETTINGS.timeout_s, "max_concurrency": SETTINGS.max_concurrency},
    logging={
        "access": {
            "enabled": SETTINGS.access_log,
            "skip_paths": ["/metrics", "/healthz", "/livez", "/readyz"],
        }
    },
)
class ImageClassifier:
    """Any trainyard model: the ONNX file the pipeline exported and verified, and the
    dataset card it carries (classes, channels, size, resize policy, normalisation)."""

    def __init__(self) -> None:
        self.params = SETTINGS
        self.model_path = MODEL_PATH
        self.model, self.sha256 = load_model(MODEL_PATH, SETTINGS)
        # The dataset card the model carries: channels, size, resize policy, normalisation.
        self.card = card_from_metadata(self.model.metadata, str(MODEL_PATH))
        self.classes = self.model.classes
        self.version = self.sha256[:12]
        self._batcher: Callable[[np.ndarray], Awaitable[np.ndarray | None]] | None = None
        self._limiter: Any = None  # anyio.CapacityLimiter, made on this worker's loop
        # Everything built so far (BentoML, pydantic, ONNX Runtime, the model) lives as long as
        # the process: freezing it keeps the collector from re-scanning it on every full
        # collection, which stalled ~1% of requests for 50-150 ms (p99; make bench-serve).
        gc.collect()
        gc.freeze()
        log.info(
            "trainyard: serving %s (sha256 %s, %d classes, input %s, resize %s) on %s; "
            "params %s; %d ONNX Runtime thread(s), %d inference(s) at once; batching %s",
            MODEL_PATH,
            self.sha256,
            len(self.classes),
            image_shape_text(self.card),
            self.card.resize,
            self.model.provider,
            PARAMS_FILE,
            SETTINGS.model_threads(),
            SETTINGS.concurrent_inferences(),
            f"on (max {SETTINGS.max_batch_size}, {SETTINGS.max_latency_ms} ms)"
            if SETTINGS.batching
            else "off",
        )

    @bentoml.on_startup
    def warm_up(self) -> None:
        """Before /readyz says ready, per worker: one decode of each common format (Pillow
        imports its format plugins on first use) and one inference (ONNX Runtime allocates
        its arenas and picks kernels on the first run). Otherwise the first requests pay
        for both. Not counted in the monitoring series."""
        import io

        from PIL import Image

        for fmt in ("PNG", "JPEG"):
            buf = io.BytesIO()
            Image.new("RGB", (2 * self.card.width, 2 * self.card.height)).save(buf, fmt)
            decode_image(buf.getvalue(), self.card)
        c, h, w = self.card.input_shape
        self.model.run(normalize(np.zeros((1, c, h, w), dtype=np.float32), self.card))

    @bentoml.on_startup
    def refuse_connections_on_sigterm(self) -> None:
        """On SIGTERM, stop the port listening before uvicorn drains (tests/test_serving_drain.py).

        BentoML already drains: `bentoml serve` (circus) passes SIGTERM on to each worker,
        whose uvicorn stops accepting, lets every request in flight finish (each bounded by
        serve.timeout_s) and exits; then the main process exits 0. But the listening socket
        is shared with the main process, which closes it only after the last worker has gone,
        so meanwhile the kernel still completes new connections into the backlog, and they
        are reset when it closes. ``shutdown()`` on the shared socket stops it listening for
        every process at once: a new connection is refused (safe for a client or proxy to
        retry elsewhere) rather than reset after its request was sent. uvicorn's own handler
        then runs as before."""
        import signal
        import socket

        import psutil

        listening = [
            conn.fd
            for conn in psutil.Process().net_connections("tcp")
            if conn.status == psutil.CONN_LISTEN and conn.fd >= 0
        ]
        uvicorn_handler = signal.getsignal(signal.SIGTERM)
        if not listening or not callable(uvicorn_handler):
            return

        def stop_listening(sig: int, frame: Any) -> None:
            for fd in listening:
                try:
                    with socket.socket(fileno=os.dup(fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already shut by another worker, or closed
                    pass
            uvicorn_handler(sig, frame)

        signal.signal(signal.SIGTERM, stop_listening)

    # ------------------------------------------------------------------ model

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread, at most ``concurrent_inferences`` at once
        (FIFO): CPU work beyond the worker's cores only queues inside ONNX Runtime."""
        import anyio.to_thread

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.params.concurrent_inferences())
        return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=self._limiter)

    def probabilities(self, pixels: np.ndarray) -> np.ndarray:
        """Pixels 0–255 [N,C,H,W] -> softmax probabilities [N,classes] (float32)."""
        if pixels.ndim != 4 or pixels.shape[1:] != self.card.input_shape:
            raise ValueError(
                f"pixels must be [N,{','.join(map(str, self.card.input_shape))}], "
                f"got {list(pixels.shape)}"
            )
        BATCH_SIZE.observe(pixels.shape[0])
        return softmax(self.model.run(normalize(pixels, self.card)))

    async def probabilities_one(self, pixels: np.ndarray) -> np.ndarray:
        """[C,H,W] -> [classes]: through the adaptive batcher when batching is on."""
        x = pixels[None].astype(np.float32)
        if not self.params.batching:
            return (await self.in_thread(self.probabilities, x))[0]
        if self._batcher is None:  # created on first use, on this worker's event loop
            self._batcher = _adaptive_batcher(self)
        probs = await self._batcher(x)
        if probs is None:  # shed: the queue could not be served within max_latency_ms
            raise Refused(
                503,
                "server overloaded: the request could not be answered within "
                f"serve.max_latency_ms ({self.params.max_latency_ms} ms); retry shortly",
                field=None,
                reason="overloaded",
                headers={"retry-after": "1"},
            )
        return probs[0]

    def prediction(self, probs: np.ndarray, top_k: int) -> dict[str, Any]:
        order = np.argsort(-probs, kind="stable")[:top_k]
        best = int(order[0])
        label = self.classes[best]
        PREDICTIONS.labels(label=label).inc()
        CONFIDENCE.observe(float(probs[best]))
        return {
            "label": label,
            "class_id": best,
            "probabilities": probs.tolist(),
            "top_k": [
                {"label": self.classes[int(i)], "class_id": int(i), "probability": float(probs[i])}
                for i in order
            ],
            "model_version": self.version,
        }

    def decode(self, data: bytes, field: str, invert: bool) -> np.ndarray:
        """Image bytes -> uint8 [C,H,W] by the card (the function prepare used)."""
        info: dict[str, Any] = {}
        try:
            return decode_image(
                data,
                self.card,
                invert=invert,
                max_pixels=self.params.max_image_pixels,
                field=field,
                info=info,
            )
        except InputError as err:
            reason = "image_too_large" if err.status == 413 else "bad_image"
            raise Refused.from_input(err, reason) from None
        finally:
            if "width" in info:
                IMAGE_PIXELS.observe(info["width"] * info["height"])

    # ------------------------------------------------------------------ endpoints

    async def classify(self, request: Request, body: bytes) -> dict[str, Any]:
        media = _media_type(request)
        query = request.query_params
        if media == "multipart/form-data":
            form = await _parse_form(
                request,
                body,
                files="image",
                texts=("invert", "top_k"),
                max_files=1,
                usage=CLASSIFY_USAGE,
            )
            try:
                images = await _file_fields(form, "image", CLASSIFY_USAGE)
                if len(images) != 1:
                    raise Refused(
                        400,
                        f"image: expected one file field 'image', got {len(images)}; "
                        f"{CLASSIFY_USAGE}",
                        field="image",
                        reason="bad_field",
                    )
                invert = _flag("invert", _text(form, "invert") or query.get("invert"))
                top_k = _top_k(
                    _text(form, "top_k") or query.get("top_k"),
                    len(self.classes),
                    self.params.top_k,
                )
            finally:
                await form.close()
            data = images[0]
        elif media.startswith("image/"):
            invert = _flag("invert", query.get("invert"))
            top_k = _top_k(query.get("top_k"), len(self.classes), self.params.top_k)
            data = body
        else:
            raise _unsupported("/classify", media, CLASSIFY_USAGE)
        if not data:
            raise Refused(
                400,
                f"image: the image is empty (0 bytes); {CLASSIFY_USAGE}",
                field="image",
                reason="bad_image",
            )
        if not self.params.batching:
            # Decode and inference in one worker-thread hop: each hop costs a GIL handoff.
            return await self.in_thread(self._classify_now, data, invert, top_k)
        pixels = await self.in_thread(self.decode, data, "image", invert)
        return self.prediction(await self.probabilities_one(pixels), top_k)

    def _classify_now(self, data: bytes, invert: bool, top_k: int) -> dict[str, Any]:
        pixels = self.decode(data, "image", invert)
        return self.prediction(self.probabilities(pixels[None].astype(np.float32))[0], top_k)

    async def classify_batch(self, request: Request, body: bytes) -> list[dict[str, Any]]:
        media = _media_type(request)
        query = request.query_params
        limit = self.params.max_batch_images
        top_k = _top_k(query.get("top_k"), len(self.classes), self.params.top_k)
        if media == "multipart/form-data":
            form = await _parse_form(
                request,
                body,
                files="images",
                texts=("invert",),
                max_files=limit,
                usage=BATCH_USAGE,
            )
            try:
                files = await _file_fields(form, "images", BATCH_USAGE)
                invert = _flag("invert", _text(form, "invert") or query.get("invert"))
            finally:
                await form.close()
            _check_count(len(files), limit)
            pixels = await self.in_thread(self._decode_all, files, invert)
        elif media == "application/json":
            pixels = await self.in_thread(self._json_pixels, body)
        else:
            raise _unsupported("/classify_batch", media, BATCH_USAGE)
        probs = await self.in_thread(self.probabilities, pixels)
        return [self.prediction(row, top_k) for row in probs]

    def _decode_all(self, files: Sequence[bytes], invert: bool) -> np.ndarray:
        c, h, w = self.card.input_shape
        out = np.empty((len(files), c, h, w), dtype=np.float32)
        for i, data in enumerate(files):
            if not data:
                raise Refused(
                    400,
                    f"images[{i}]: the image is empty (0 bytes)",
                    field=f"images[{i}]",
                    reason="bad_image",
                )
            out[i] = self.decode(data, f"images[{i}]", invert)
        return out

    def _json_pixels(self, body: bytes) -> np.ndarray:
        import json

        try:
            doc = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise Refused(
                400,
                f"body: Invalid JSON ({err}); {BATCH_USAGE}",
                field="body",
                reason="bad_request",
            ) from None
        if not isinstance(doc, dict) or "images" not in doc:
            raise Refused(
                400, f"images: missing; {BATCH_USAGE}", field="images", reason="bad_field"
            )
        unknown = sorted(set(doc) - {"images"})
        if unknown:
            raise Refused(
                400,
                f"{unknown[0]}: unknown field; {BATCH_USAGE}",
                field=unknown[0],
                reason="bad_field",
            )
        try:
            return pixel_arrays(doc["images"], self.card, max_images=self.params.max_batch_images)
        except InputError as err:
            reason = "too_many_images" if err.status == 413 else "bad_field"
            raise Refused.from_input(err, reason) from None

    def describe(self) -> dict[str, Any]:
        """What GET /metadata answers: the model's identity, contract and provider."""
        meta = self.model.metadata
        c = self.card
        return {
            "model": {
                "path": str(self.model_path),
                "sha256": self.sha256,
                "version": self.version,
                "arch": meta.get("arch"),
                "trainyard_version": meta.get("trainyard_version"),
                "mlflow_run_id": meta.get("mlflow_run_id"),
                "data_sha256": meta.get("data_sha256"),
                "checkpoint_sha256": meta.get("checkpoint_sha256"),
            },
            "classes": self.classes,
            "dataset_card": c.contract(),
            "input": {
                "shape": [-1, *c.input_shape],
                "image": image_shape_text(c),
                "dtype": meta.get("input_dtype", "float32"),
                "normalization": {"scale": 255.0, "mean": list(c.mean), "std": list(c.std)},
                "resize": c.resize,
                "image_formats": list(IMAGE_FORMATS),
                "max_image_pixels": self.params.max_image_pixels,
                "max_batch_images": self.params.max_batch_images,
                "max_body_bytes": self.params.max_body_bytes,
                "top_k": self.params.top_k,
            },
            "endpoints": {
                "POST /classify": CLASSIFY_USAGE + "; query: top_k, invert",
                "POST /classify_batch": BATCH_USAGE + "; query: top_k",
                "GET /metadata": "this document",
            },
            "source": PROVENANCE,
            "provider": self.model.provider,
            "device": self.params.device,
            "threads": {
                "onnxruntime_intra_op": self.params.model_threads(),
                "concurrent_inferences": self.params.concurrent_inferences(),
            },
            "batching": {
                "enabled": self.params.batching,
                "max_batch_size": self.params.max_batch_size,
                "max_latency_ms": self.params.max_latency_ms,
            },
        }


def _text(form: FormData, key: str) -> str | None:
    value = form.get(key)
    return value if isinstance(value, str) else None


def _check_count(n: int, limit: int) -> None:
    if n == 0:
        raise Refused(
            400, f"images: no image files; {BATCH_USAGE}", field="images", reason="bad_field"
        )
    if n > limit:
        raise Refused(
            413,
            f"images: more than the limit of {limit} per request (serve.max_batch_images); "
            "split them over several requests",
            field="images",
            reason="too_many_images",
        )


def _adaptive_batcher(
    service: ImageClassifier,
) -> Callable[[np.ndarray], Awaitable[np.ndarray | None]]:
    """BentoML's adaptive batcher (the CorkDispatcher behind ``batchable=True`` APIs),
    driven with decoded pixels: it learns the model's cost per batch and waits for more
    requests only while that keeps every queued request within max_latency_ms, shedding
    (None -> 503) those it cannot. Imported from BentoML's internals, so the bento pins
    BentoML's minor version and tests/test_serving.py exercises it on every run."""
    import anyio.to_thread
    from bentoml._internal.marshal.dispatcher import CorkDispatcher, NonBlockSema

    dispatcher: Any = CorkDispatcher(
        max_latency_in_ms=service.params.max_latency_ms,
        max_batch_size=service.params.max_batch_size,
        fallback=lambda: None,
        get_batch_size=lambda x: x.shape[0],
        batch_dim=(0, 0),
        # One batch in flight per core of the worker (BentoML's default is one in all),
        # so a CPU worker keeps every core busy with batches, one thread each.
        shared_sema=NonBlockSema(service.params.concurrent_inferences()),
    )

    async def run(batches: Sequence[np.ndarray]) -> list[np.ndarray]:
        sizes = np.cumsum([b.shape[0] for b in batches])[:-1]
        x = np.concatenate(batches)
        # Not through the worker's limiter: the semaphore above already bounds the batches,
        # and decodes waiting on the limiter behind them would starve the next batch.
        probs = await anyio.to_thread.run_sync(service.probabilities, x)
        return np.split(probs, sizes)

    return dispatcher(run)


def _service() -> ImageClassifier:
    return bentoml.get_current_service()  # type: ignore[no-any-return]


def _endpoint(
    name: str,
) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def handle(request: Request) -> JSONResponse:
        try:
            body = await request.body()
            if not body:
                usage = CLASSIFY_USAGE if name == "classify" else BATCH_USAGE
                raise Refused(
                    400, f"empty request body; {usage}", field="body", reason="bad_request"
                )
            result = await getattr(_service(), name)(request, body)
        except Refused as err:
            return err.response()
        return JSONResponse(result)

    handle.__name__ = name
    return handle


async def _metadata(request: Request) -> JSONResponse:
    return JSONResponse(_service().describe())


async def _not_found(request: Request, exc: Exception | None = None) -> JSONResponse:
    # JSON like every other answer, and the list of what exists.
    status = getattr(exc, "status_code", 404)
    REFUSED.labels(reason="not_found" if status == 404 else "method_not_allowed").inc()
    return JSONResponse(
        {
            "error": f"{request.method} {request.url.path}: "
            + ("Not Found" if status == 404 else "Method Not Allowed")
            + "; endpoints: POST /classify, POST /classify_batch, GET /metadata, "
            "GET /healthz, GET /readyz, GET /livez, GET /metrics",
            "field": None,
        },
        status,
    )


ImageClassifier.mount_asgi_app(
    Starlette(
        exception_handlers={404: _not_found, 405: _not_found},
        routes=[
            Route("/classify", _endpoint("classify"), methods=["POST"]),
            Route("/classify_batch", _endpoint("classify_batch"), methods=["POST"]),
            Route("/metadata", _metadata, methods=["GET"]),
            # Last: any other path. The mount sees only what BentoML's own routes did not
            # take, and Starlette's default 404 there is plain text.
            Route("/{path:path}", _not_found, methods=["GET", "HEAD", "POST", "PUT", "DELETE"]),
        ],
    ),
    path="/",
)
ImageClassifier.add_asgi_middleware(
    RequestGuard,
    api_key=os.environ.get(API_KEY_ENV) or None,
    max_body_bytes=SETTINGS.max_body_bytes,
)
