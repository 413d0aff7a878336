"""A Python client for the trainyard service (``POST /classify``, ``POST /classify_batch``,
``GET /metadata``): images in, typed answers out, the server's own error text on failure.

Standard library and httpx only, so it installs anywhere: no NumPy, no Pillow. A PIL image
is taken by duck typing (anything with ``.save(fp, format=...)`` is encoded to PNG).

    with Client("http://127.0.0.1:3000", api_key=key) as client:
        answer = client.classify("shoe.png", top_k=3)
        print(answer.label, answer.probability)

Errors: ``ServiceError`` (the server answered 4xx/5xx; its str is the server's message),
``ConnectionFailed`` (no answer: refused, unknown host, reset; names the URL), ``TimedOut``
(a ``ConnectionFailed``: no answer within the timeout) and ``UnexpectedResponse`` (a 2xx
whose JSON is not what the service answers). All are ``ClientError``s.
"""

from __future__ import annotations

import io
import mimetypes
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import IO, Any, Protocol, TypeAlias

import httpx

from trainyard import __version__

__all__ = [
    "Classification",
    "Client",
    "ClientError",
    "ConnectionFailed",
    "ImageInput",
    "ModelCard",
    "Prediction",
    "ServiceError",
    "TimedOut",
    "UnexpectedResponse",
]

DEFAULT_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0  # at most: a dead host should fail fast, a slow model may not
OCTET_STREAM = "application/octet-stream"
# (magic prefix, content type, extension) for the formats the service decodes.
MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png", ".png"),
    (b"\xff\xd8\xff", "image/jpeg", ".jpg"),
    (b"GIF87a", "image/gif", ".gif"),
    (b"GIF89a", "image/gif", ".gif"),
    (b"BM", "image/bmp", ".bmp"),
    (b"II*\x00", "image/tiff", ".tif"),
    (b"MM\x00*", "image/tiff", ".tif"),
)


# ---------------------------------------------------------------------------- errors


class ClientError(Exception):
    """Anything this client raises about a request (not about the arguments)."""


class ServiceError(ClientError):
    """The service answered with an error status; ``str()`` is the server's message.

    ``status`` is the HTTP status, ``field`` the request field at fault (or None),
    ``retry_after`` the seconds a 429/503 asks to wait (or None).
    """

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"ServiceError(status={self.status}, message={self.message!r}, field={self.field!r})"


class ConnectionFailed(ClientError, ConnectionError):
    """No answer from the service: connection refused, unknown host, reset, bad TLS."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class TimedOut(ConnectionFailed, TimeoutError):
    """No answer within the client's timeout."""


class UnexpectedResponse(ClientError):
    """A success status whose body is not the JSON the service answers."""


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Prediction:
    """One class and its probability."""

    label: str
    class_id: int
    probability: float

    @classmethod
    def from_json(cls, doc: Any) -> Prediction:
        """``{"label", "class_id", "probability"}`` -> Prediction."""
        d = _mapping(doc, "prediction")
        return cls(
            label=_typed(d, "label", str),
            class_id=_typed(d, "class_id", int),
            probability=float(_typed(d, "probability", (int, float))),
        )


@dataclass(frozen=True)
class Classification:
    """The service's answer for one image: the top class, every class's probability (in
    class_id order), the ``top_k`` best, and the version (sha256 prefix) of the model."""

    label: str
    class_id: int
    probabilities: tuple[float, ...]
    top_k: tuple[Prediction, ...]
    model_version: str

    @property
    def probability(self) -> float:
        """The probability of the top class."""
        return self.probabilities[self.class_id]

    @classmethod
    def from_json(cls, doc: Any) -> Classification:
        """The JSON of one answer of /classify (or one item of /classify_batch)."""
        d = _mapping(doc, "classification")
        probs = _typed(d, "probabilities", list)
        top = _typed(d, "top_k", list)
        if not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in probs):
            raise UnexpectedResponse("'probabilities': expected a list of numbers")
        class_id = _typed(d, "class_id", int)
        if not 0 <= class_id < len(probs):
            raise UnexpectedResponse(f"'class_id' {class_id} outside the {len(probs)} classes")
        return cls(
            label=_typed(d, "label", str),
            class_id=class_id,
            probabilities=tuple(float(p) for p in probs),
            top_k=tuple(Prediction.from_json(p) for p in top),
            model_version=_typed(d, "model_version", str),
        )


def _frozen(value: Any) -> Mapping[str, Any]:
    return MappingProxyType(dict(value)) if isinstance(value, Mapping) else MappingProxyType({})


@dataclass(frozen=True)
class ModelCard:
    """What ``GET /metadata`` says about the served model.

    ``input`` is the input contract (shape, normalisation, resize, limits, formats),
    ``source`` where the model came from (params, model file), ``raw`` the whole document.
    Mappings are read-only and take no part in equality.
    """

    path: str
    sha256: str
    version: str
    classes: tuple[str, ...]
    arch: str | None = None
    mlflow_run_id: str | None = None
    data_sha256: str | None = None
    trainyard_version: str | None = None
    provider: str | None = None
    input: Mapping[str, Any] = field(default_factory=dict, compare=False)
    source: Mapping[str, Any] = field(default_factory=dict, compare=False)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, doc: Any) -> ModelCard:
        """The JSON answer of ``GET /metadata``."""
        d = _mapping(doc, "metadata")
        model = _mapping(d.get("model"), "'model'")
        classes = _typed(d, "classes", list)
        if not all(isinstance(c, str) for c in classes):
            raise UnexpectedResponse("'classes': expected a list of names")

        def opt(key: str) -> str | None:
            value = model.get(key)
            return value if isinstance(value, str) else None

        provider = d.get("provider")
        return cls(
            path=_typed(model, "path", str),
            sha256=_typed(model, "sha256", str),
            version=_typed(model, "version", str),
            classes=tuple(classes),
            arch=opt("arch"),
            mlflow_run_id=opt("mlflow_run_id"),
            data_sha256=opt("data_sha256"),
            trainyard_version=opt("trainyard_version"),
            provider=provider if isinstance(provider, str) else None,
            input=_frozen(d.get("input")),
            source=_frozen(d.get("source")),
            raw=_frozen(d),
        )


def _mapping(doc: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise UnexpectedResponse(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _typed(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``d[key]``, checked to be a ``kind`` (a bool is not a number here)."""
    if key not in d:
        raise UnexpectedResponse(f"missing {key!r} in the answer")
    value = d[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise UnexpectedResponse(f"{key!r}: unexpected {type(value).__name__} {value!r:.80}")
    return value


# ---------------------------------------------------------------------------- images


class SupportsSave(Protocol):
    """A PIL.Image-like object: ``save(fp, format=...)`` writes it in that format."""

    def save(self, fp: IO[bytes], format: str | None = ...) -> None:
        """Write the image to ``fp`` in ``format`` (PIL.Image.Image.save)."""


ImageInput: TypeAlias = str | os.PathLike[str] | bytes | bytearray | memoryview | SupportsSave


def sniff(data: bytes) -> tuple[str, str] | None:
    """(content type, extension) of image bytes by their magic number, or None."""
    for magic, ctype, ext in MAGIC:
        if data.startswith(magic):
            return ctype, ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp", ".webp"
    if data[4:8] == b"ftyp":  # ISO-BMFF: the brand says HEIC (phones) or AVIF
        brand = data[8:12]
        if brand in (b"avif", b"avis"):
            return "image/avif", ".avif"
        if brand in (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"):
            return "image/heic", ".heic"
    return None


def encode_image(image: ImageInput, name: str = "image") -> tuple[str, bytes, str]:
    """(filename, bytes, content type) of a path, image bytes or a PIL-like image.

    The content type comes from the bytes' magic number, then from the file's extension,
    else ``application/octet-stream`` (the service decodes by content, not by type).
    """
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        ctype, ext = sniff(data) or (OCTET_STREAM, "")
        return f"{name}{ext}", data, ctype
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        data = path.read_bytes()
        found = sniff(data)
        ctype = found[0] if found else mimetypes.guess_type(path.name)[0] or OCTET_STREAM
        return path.name or name, data, ctype
    if callable(getattr(image, "save", None)):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return f"{name}.png", buf.getvalue(), "image/png"
    raise TypeError(
        "image: expected a file path, image bytes or a PIL.Image (anything with "
        f".save(fp, format=...)), got {type(image).__name__}"
    )


# ---------------------------------------------------------------------------- client


class Client:
    """The trainyard service at ``url`` (e.g. ``http://127.0.0.1:3000``).

    ``api_key`` is sent as ``Authorization: Bearer <key>`` (the server's
    TRAINYARD_API_KEY). ``timeout`` (seconds, or an ``httpx.Timeout``) bounds each
    request; connecting takes at most 5 s of it. One client is safe to share between
    threads and keeps its connections open: close it, or use it as a context manager.
    ``transport`` replaces httpx's (tests use ``httpx.MockTransport``).
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http://host:port or https://..., got {url!r}")
        if not isinstance(timeout, httpx.Timeout):
            timeout = httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))
        headers = {"User-Agent": f"trainyard-client/{__version__}", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (the client cannot be used afterwards)."""
        self._http.close()

    # ------------------------------------------------------------------ endpoints

    def classify(
        self, image: ImageInput, top_k: int | None = None, *, invert: bool = False
    ) -> Classification:
        """Classify one image (path, bytes or PIL-like image) with ``POST /classify``.

        ``top_k``: how many classes the answer's ``top_k`` lists (the server's default
        when None); ``invert``: the service inverts the image first (dark on light).
        """
        form = {"invert": "true"} if invert else None
        doc = self._request(
            "POST",
            "/classify",
            params=_query(top_k),
            files={"image": encode_image(image)},
            data=form,
        )
        return Classification.from_json(doc)

    def classify_batch(
        self, images: Iterable[ImageInput], top_k: int | None = None, *, invert: bool = False
    ) -> list[Classification]:
        """Classify several images in one ``POST /classify_batch``, answers in order.

        An empty list answers ``[]`` without a request. The server takes at most its
        ``input.max_batch_images`` (see ``metadata()``) per request, 413 beyond.
        """
        files = [("images", encode_image(im, f"image-{i}")) for i, im in enumerate(images)]
        if not files:
            return []
        form = {"invert": "true"} if invert else None
        doc = self._request("POST", "/classify_batch", params=_query(top_k), files=files, data=form)
        if not isinstance(doc, list) or len(doc) != len(files):
            got = f"{len(doc)} answers" if isinstance(doc, list) else type(doc).__name__
            raise UnexpectedResponse(f"expected {len(files)} answers, got {got}")
        return [Classification.from_json(item) for item in doc]

    def metadata(self) -> ModelCard:
        """The served model's card (``GET /metadata``): identity, classes, input contract."""
        return ModelCard.from_json(self._request("GET", "/metadata"))

    def ready(self) -> bool:
        """Whether the service answers ``GET /readyz`` with 200 (False when unreachable)."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    # ------------------------------------------------------------------ transport

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer of one request; a ClientError for anything else."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as err:
            raise TimedOut(
                f"{method} {self.url}{path}: no answer within the timeout ({_why(err)})",
                self.url,
            ) from err
        except httpx.TransportError as err:
            raise ConnectionFailed(
                f"cannot reach the trainyard service at {self.url} ({_why(err)})", self.url
            ) from err
        if resp.status_code >= 400:
            raise service_error(resp)
        try:
            return resp.json()
        except ValueError:
            raise UnexpectedResponse(
                f"{method} {self.url}{path}: HTTP {resp.status_code} but not JSON: "
                f"{resp.text[:200]!r}"
            ) from None


def _query(top_k: int | None) -> dict[str, str] | None:
    return None if top_k is None else {"top_k": str(top_k)}


def _why(err: Exception) -> str:
    return str(err) or type(err).__name__


def service_error(resp: httpx.Response) -> ServiceError:
    """The ServiceError for an error answer: the server's ``{"error", "field"}`` when it
    sent that JSON, else the status and the start of the body (a proxy's page, say)."""
    message, field_name = None, None
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if isinstance(doc, Mapping) and isinstance(doc.get("error"), str):
        message = doc["error"]
        field_name = doc.get("field") if isinstance(doc.get("field"), str) else None
    if message is None:
        text = resp.text.strip()[:200]
        message = f"HTTP {resp.status_code} {resp.reason_phrase}" + (f": {text}" if text else "")
    return ServiceError(
        resp.status_code,
        message,
        field_name,
        retry_after=_retry_after(resp.headers.get("retry-after")),
    )


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: a number, or an HTTP date (seconds from now)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
        return max(0.0, (when - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None
