"""BentoML service: the exported ONNX model over HTTP, on CUDA or CPU, refusing bad input.

    make serve          # bentoml serve serving.service:FashionClassifier on 127.0.0.1:3000
    curl -F image=@shirt.png http://127.0.0.1:3000/classify

Everything the model needs to know about its input (size, normalisation, class names) is
read from the ONNX metadata; the knobs are the ``serve`` section of params.yaml. Requests
pass a guard (API key, content type, body size, no pickle) before BentoML parses anything.
"""

from __future__ import annotations

import gc
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Annotated, Any

import bentoml
import numpy as np
from bentoml.exceptions import BentoMLException
from bentoml.validators import DType
from pydantic import BaseModel, Field, WithJsonSchema
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from trainyard.card import card_from_metadata
from trainyard.config import ServeParams, load_params
from trainyard.errors import InputError, ModelError
from trainyard.inference import OnnxModel, choose_providers, load_onnx
from trainyard.io import sha256_file
from trainyard.preprocess import (
    IMAGE_FORMATS,
    decode_image,
    image_shape_text,
    normalize,
    pixel_arrays,
    softmax,
)
from trainyard.registry import fetch_registered_onnx

# bentoml.serve's handlers are the ones `bentoml serve` prints; a child logger shares them.
log = logging.getLogger("bentoml.serve.trainyard")

PARAMS_ENV, MODEL_ENV, API_KEY_ENV = "TRAINYARD_PARAMS", "TRAINYARD_MODEL", "TRAINYARD_API_KEY"
CACHE_ENV = "TRAINYARD_MODEL_CACHE"
INTERNAL_ROUTE = "/internal/infer"
INTERNAL_HEADER = "x-trainyard-internal"
# Per process: only this process's own in-memory client (the batching hop) can reach
# INTERNAL_ROUTE; to anyone else it does not exist.
_INTERNAL_TOKEN = secrets.token_urlsafe(32)


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
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
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
        model = load_onnx(path, device=params.device, intra_op_threads=params.intra_op_threads)
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


# ---------------------------------------------------------------------------- request guard

# Reachable without the API key (probes, metrics, the docs UI); everything else needs it.
OPEN_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/metrics", "/", "/docs.json"})
OPEN_PREFIXES = ("/static_content/", "/assets/")
# What each prediction endpoint accepts; anything else is refused before parsing.
CONTENT_TYPES = {
    "/classify": (
        "multipart/form-data",
        "send the image as a multipart file field: curl -F image=@shirt.png URL/classify",
    ),
    "/classify_batch": (
        "application/json",
        'send JSON: {"images": [arrays of 0–255 numbers shaped as GET /metadata input.image]}',
    ),
}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class RequestGuard:
    """Pure ASGI middleware in front of BentoML's request parsing.

    - API key (when set): ``Authorization: Bearer <key>``, constant-time compare, 401 else;
    - ``application/vnd.bentoml+pickle`` -> 415 on every route (never unpickle a request);
    - a prediction endpoint with the wrong content type -> 415 saying what to send;
    - a body over ``max_body_bytes`` -> 413, read no further (Content-Length or counted);
    - the internal batching route only for this process's own client (404 for others).
    """

    def __init__(
        self, app: Any, *, api_key: str | None, internal_token: str, max_body_bytes: int
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.internal_token = internal_token.encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_trace_headers(send)
        path, method = scope["path"], scope["method"]
        headers = Headers(scope=scope)
        if path == INTERNAL_ROUTE:
            given = headers.get(INTERNAL_HEADER, "").encode("latin-1")
            if not hmac.compare_digest(given, self.internal_token):
                await _error(send, scope, 404, "Not Found")
                return
            await self.app(scope, receive, send)
            return
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
                "pickle request bodies are refused; send JSON or multipart",
                field="Content-Type",
            )
            return
        expected = CONTENT_TYPES.get(path)
        if expected is not None and media != expected[0]:
            got = f"'{media}'" if media else "no Content-Type"
            await _error(
                send,
                scope,
                415,
                f"{path} takes {expected[0]}, got {got}; {expected[1]}",
                field="Content-Type",
            )
            return
        body = await self._read_body(scope, receive, send, headers)
        if body is None:
            return
        if expected is not None and not body:
            await _error(send, scope, 400, f"empty request body; {expected[1]}", field="body")
            return
        if path == "/classify":
            problem = await _classify_form_problem(headers, body)
            if problem is not None:
                await _error(send, scope, 400, problem[1], field=problem[0])
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
                await _error(send, scope, 400, "Content-Length is not a number", field="body")
                return None
            if int(declared) > limit:
                await _error(send, scope, 413, too_big, field="body")
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:  # chunked upload that never declared its length
                await _error(send, scope, 413, too_big, field="body")
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


CLASSIFY_FIELDS = ("image", "invert")


async def _classify_form_problem(headers: Headers, body: bytes) -> tuple[str, str] | None:
    """(field, message) if /classify's multipart body is not one `image` file (+ `invert`).

    BentoML answers these with a 500 (a text field is json-decoded, a malformed body
    raises), and it fetches a *text* `image` value as a URL; checking the form here turns
    all of them into a 400 that names the field, and no URL is ever fetched.
    """
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def stream() -> Any:
        yield body

    try:
        parser = MultiPartParser(headers, stream(), max_files=4, max_fields=8)
        form = await parser.parse()
    except MultiPartException as err:
        return "body", f"body: malformed multipart/form-data ({err.message})"
    try:
        unknown = sorted(set(form.keys()) - set(CLASSIFY_FIELDS))
        if unknown:
            return unknown[0], (
                f"{unknown[0]}: unknown form field; /classify takes a file field 'image' "
                "and an optional 'invert' (true/false)"
            )
        images = form.getlist("image")
        if len(images) != 1:
            return "image", (
                f"image: expected one file field 'image', got {len(images)}; "
                "send curl -F image=@shirt.png URL/classify"
            )
        if not isinstance(images[0], UploadFile):
            return "image", "image: must be a file upload (curl -F image=@shirt.png), not text"
        if any(isinstance(v, UploadFile) for v in form.getlist("invert")):
            return "invert", "invert: must be the text true or false, not a file"
        return None
    finally:
        await form.close()


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
    field: str | None = None,
    extra_headers: dict[str, str] | None = None,
) -> None:
    response = JSONResponse({"error": message, "field": field}, status, extra_headers)

    async def no_body() -> Message:  # the response never reads the request
        return {"type": "http.disconnect"}

    await response(scope, no_body, send)


# ---------------------------------------------------------------------------- API types


class Prediction(BaseModel):
    label: str = Field(description="class name, e.g. 'Shirt'")
    class_id: int = Field(description="index of the class in /metadata's classes")
    probabilities: list[float] = Field(description="softmax over all classes; sums to 1")
    model_version: str = Field(description="first 12 hex digits of the model's sha256")


def _error_response(err: InputError) -> JSONResponse:
    return JSONResponse(err.to_json(), status_code=err.status)


_ImagesField = Annotated[
    list[Any],
    # Validated by trainyard.preprocess.pixel_arrays (first error only, field and index
    # named); the schema is what the Swagger UI shows.
    WithJsonSchema(
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "number", "minimum": 0, "maximum": 255},
                },
            },
            "description": (
                "images, pixel values 0–255, shaped as GET /metadata's input.image: "
                "H rows of W numbers for a grayscale model, C planes of those for colour"
            ),
        }
    ),
]


# ---------------------------------------------------------------------------- service


@bentoml.service(
    name="trainyard_classifier",
    workers=SETTINGS.workers,
    traffic={"timeout": SETTINGS.timeout_s, "max_concurrency": SETTINGS.max_concurrency},
    # The batching hop's in-process client: BentoML >= 1.4.30 recycles its session every
    # 100 requests and closes it under in-flight calls ("Server disconnected" -> 500 under
    # load; bentoml#5540, #5544). One session for the process's life avoids that.
    runner_connection={"max_requests": 2**31 - 1, "max_age": 1e9},
    # The outer /classify request is logged; its internal batching hop would double the lines.
    logging={
        "access": {"skip_paths": ["/metrics", "/healthz", "/livez", "/readyz", INTERNAL_ROUTE]}
    },
)
class FashionClassifier:
    """Fashion-MNIST classifier: the ONNX model the pipeline exported and verified."""

    def __init__(self) -> None:
        self.params = SETTINGS
        self.model_path = MODEL_PATH
        self.model, self.sha256 = load_model(MODEL_PATH, SETTINGS)
        # The dataset card the model carries: channels, size, resize policy, normalisation.
        self.card = card_from_metadata(self.model.metadata, str(MODEL_PATH))
        self.classes = self.model.classes
        self.version = self.sha256[:12]
        self._internal_ready = False
        # Everything built so far (BentoML, pydantic, ONNX Runtime, the model) lives as long as
        # the process: freezing it keeps the collector from re-scanning it on every full
        # collection, which stalled ~1% of requests for 50-150 ms (p99; make bench-serve).
        gc.collect()
        gc.freeze()
        log.info(
            "trainyard: serving %s (sha256 %s, %d classes) on %s; params %s; batching %s",
            MODEL_PATH,
            self.sha256,
            len(self.classes),
            self.model.provider,
            PARAMS_FILE,
            f"on (max {SETTINGS.max_batch_size}, {SETTINGS.max_latency_ms} ms)"
            if SETTINGS.batching
            else "off",
        )

    # The batching hop: /classify calls this through BentoML's in-process client, so the
    # adaptive batcher merges concurrent requests into one ONNX Runtime run.
    @bentoml.api(
        route=INTERNAL_ROUTE,
        batchable=SETTINGS.batching,
        batch_dim=0,
        max_batch_size=SETTINGS.max_batch_size,
        max_latency_ms=SETTINGS.max_latency_ms,
    )
    def infer(self, pixels: Annotated[np.ndarray, DType("float32")]) -> np.ndarray:
        """Internal (404 from outside): pixels 0–255 [N,C,H,W] -> probabilities [N,K]."""
        return self.probabilities(pixels)

    def probabilities(self, pixels: np.ndarray) -> np.ndarray:
        """Pixels 0–255 [N,C,H,W] -> softmax probabilities [N,classes] (float32)."""
        if pixels.ndim != 4 or pixels.shape[1:] != self.card.input_shape:
            raise ValueError(
                f"pixels must be [N,{','.join(map(str, self.card.input_shape))}], "
                f"got {list(pixels.shape)}"
            )
        return softmax(self.model.run(normalize(pixels, self.card)))

    async def _probabilities_one(self, pixels: np.ndarray) -> np.ndarray:
        if not self.params.batching:
            return await run_in_threadpool(self.probabilities, pixels)
        client = self.to_async  # type: ignore[attr-defined]  # set by BentoML at start-up
        if not self._internal_ready:
            # The in-process client builds its sessions from this dict, lazily, on first use.
            client.default_headers[INTERNAL_HEADER] = _INTERNAL_TOKEN
            self._internal_ready = True
        return await client.infer(pixels)

    def _predictions(self, probs: np.ndarray) -> list[Prediction]:
        ids = probs.argmax(axis=1)
        return [
            Prediction(
                label=self.classes[int(i)],
                class_id=int(i),
                probabilities=[float(p) for p in row],
                model_version=self.version,
            )
            for i, row in zip(ids, probs, strict=True)
        ]

    @bentoml.api
    async def classify(
        self,
        image: Annotated[Path, Field(description="a PNG or JPEG, any size and mode")],
        invert: Annotated[
            bool, Field(description="true for dark garments on a light background")
        ] = False,
    ) -> Prediction:
        """Classify one image (multipart field `image`)."""
        try:
            data = await run_in_threadpool(image.read_bytes)
            pixels = await run_in_threadpool(
                decode_image,
                data,
                self.card,
                invert=invert,
                max_pixels=self.params.max_image_pixels,
            )
        except InputError as err:
            return _error_response(err)  # type: ignore[return-value]  # BentoML sends Responses as-is
        try:
            probs = await self._probabilities_one(pixels[None].astype(np.float32))
        except BentoMLException as err:
            status = int(err.error_code)
            if status not in (429, 503):
                raise
            # The batcher shed the request (queue past max_latency_ms) or the server is full.
            return JSONResponse(  # type: ignore[return-value]
                {"error": "server overloaded; retry shortly", "field": None},
                status_code=status,
                headers={"retry-after": "1"},
            )
        return self._predictions(np.asarray(probs))[0]

    @bentoml.api
    async def classify_batch(
        self,
        images: Annotated[_ImagesField, Field(description="up to serve.max_batch_images")],
    ) -> list[Prediction]:
        """Classify a JSON list of images (arrays of 0–255 numbers), in one ONNX Runtime run."""
        try:
            pixels = pixel_arrays(images, self.card, max_images=self.params.max_batch_images)
        except InputError as err:
            return _error_response(err)  # type: ignore[return-value]
        probs = await run_in_threadpool(self.probabilities, pixels)
        return self._predictions(probs)

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
            },
            "source": PROVENANCE,
            "provider": self.model.provider,
            "device": self.params.device,
            "batching": {
                "enabled": self.params.batching,
                "max_batch_size": self.params.max_batch_size,
                "max_latency_ms": self.params.max_latency_ms,
            },
        }


async def _metadata(request: Request) -> JSONResponse:
    return JSONResponse(bentoml.get_current_service().describe())


# BentoML APIs are POST-only; GET /metadata is a small Starlette app mounted beside them.
FashionClassifier.mount_asgi_app(
    Starlette(routes=[Route("/metadata", _metadata, methods=["GET"])]), path="/"
)
FashionClassifier.add_asgi_middleware(
    RequestGuard,
    api_key=os.environ.get(API_KEY_ENV) or None,
    internal_token=_INTERNAL_TOKEN,
    max_body_bytes=SETTINGS.max_body_bytes,
)
