"""The classifier behind the endpoints: image bytes or pixels -> probabilities -> answer.

Everything the model needs to know about its input (channels, size, resize policy,
normalisation, class names) is the dataset card in the ONNX metadata. One ``Predictor``
per worker process; BentoML's service class holds it, and its api methods hand it what
they read from the request (trainyard.serve.api): bytes, pixel arrays, ints. It never sees
an HTTP request; a refusal (an image that is no image, or too large) is a ``Refused``.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
from PIL import Image

from trainyard.core.card import Card, card_from_metadata
from trainyard.core.config import ServeParams
from trainyard.core.errors import InputError
from trainyard.runtime.explain import explain_kind, heatmap_png
from trainyard.runtime.inputs import (
    IMAGE_FORMATS,
    decode_image,
    image_shape_text,
    model_input,
    softmax,
)
from trainyard.runtime.model_file import card_beside, precision_of
from trainyard.runtime.sessions import OnnxModel
from trainyard.runtime.upload_frame import upload_heatmap
from trainyard.serve.log_and_shadow import Observer, Seen
from trainyard.serve.metrics import metrics
from trainyard.serve.parsing import BATCH_USAGE, CLASSIFY_USAGE
from trainyard.serve.refused import Refused
from trainyard.serve.settings import load_model, registry_label

# Uploads up to this size are small enough to decode wherever their model call runs; a
# larger one (a photo: milliseconds to decode) never blocks the event loop.
SMALL_UPLOAD_BYTES = 64 * 1024


class Predictor:
    """Any trainyard model: the ONNX file the pipeline exported and verified, and the
    dataset card it carries (classes, channels, size, resize policy, normalisation)."""

    def __init__(
        self,
        model: OnnxModel,
        sha256: str,
        params: ServeParams,
        *,
        model_path: Path,
        provenance: dict[str, str],
    ) -> None:
        self.model, self.sha256, self.params = model, sha256, params
        self.model_path, self.provenance = model_path, provenance
        # The dataset card the model carries: channels, size, resize policy, normalisation.
        self.card: Card = card_from_metadata(model.metadata, str(model_path))
        self.classes = model.classes
        self.version = sha256[:12]
        self.metrics = metrics()  # created here, in the worker, not at import
        self._limiter: anyio.CapacityLimiter | None = None  # made on this worker's loop
        self._decoders: anyio.CapacityLimiter | None = None  # decodes before the batcher
        # The prediction log and the shadow (serve.log_and_shadow); None: neither is on.
        self.observer: Observer | None = None
        self.registry_version = registry_label(provenance)
        # fp32, or int8 (serve.precision: the export's quantized model): its own metadata says
        self.precision = precision_of(model.metadata)
        # The most images of small uploads one /classify model call (a request's, or an
        # adaptive batch's) decodes and scores on the event loop rather than on a worker
        # thread: set at start-up, where that is faster than the hop (serve.batch_choice).
        self.inline_images = 0
        # "cam" or "gradcam": how its ``cam`` output was made; None: exported before it.
        self.explain_method = explain_kind(model.metadata) if model.has_cam else None

    @classmethod
    def load(cls, path: Path, params: ServeParams, provenance: dict[str, str]) -> Predictor:
        """Verify the model against its .sha256, open it on the provider params ask for."""
        model, sha = load_model(path, params)
        return cls(model, sha, params, model_path=path, provenance=provenance)

    def startup_message(self, params_file: Path) -> str:
        """One log line: what is served, how, from which params."""
        p = self.params
        batching = f"on (max {p.max_batch_size}, {p.max_latency_ms} ms)" if p.batching else "off"
        return (
            f"trainyard: serving {self.model_path} ({self.precision}, sha256 {self.sha256}, "
            f"{len(self.classes)} classes, input {image_shape_text(self.card)}, resize "
            f"{self.card.resize}) on {self.model.provider}"
            f"{' with IO binding' if self.model.io_binding else ''}; params {params_file}; "
            f"{p.model_threads()} ONNX Runtime thread(s), {p.concurrent_inferences()} "
            f"inference(s) at once; batching {batching}"
            + (f"; {self.observer.describe()}" if self.observer is not None else "")
        )

    def warm_up(self) -> None:
        """One decode of each common format (Pillow imports its format plugins on first use)
        and one inference (ONNX Runtime allocates its arenas and picks kernels on the first
        run), so the first requests pay for neither. Not counted in the monitoring series."""
        for fmt in ("PNG", "JPEG"):
            buf = io.BytesIO()
            Image.new("RGB", (2 * self.card.width, 2 * self.card.height)).save(buf, fmt)
            decode_image(buf.getvalue(), self.card)
        c, h, w = self.card.input_shape
        self.model.run(model_input(np.zeros((1, c, h, w), dtype=np.float32), self.card))

    # ------------------------------------------------------------------ model

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread, at most ``concurrent_inferences`` at once
        (FIFO): CPU work beyond the worker's cores only queues inside ONNX Runtime."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.params.concurrent_inferences())
        return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=self._limiter)

    def probabilities(self, pixels: np.ndarray) -> np.ndarray:
        """Pixels 0–255 [N,C,H,W] -> softmax probabilities [N,classes] (float32)."""
        return self.scores(pixels)[0]

    def scores(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Pixels 0–255 [N,C,H,W] -> (probabilities [N,classes], the embeddings [N,D] when
        the prediction log keeps them and the model has them, else None)."""
        self._check_shape(pixels)
        self.metrics.batch_size.observe(pixels.shape[0])
        x = model_input(pixels, self.card)
        if self.observer is not None and self.observer.wants_embedding and self.model.has_embedding:
            logits, embedding = self.model.run_with_embedding(x)
            return softmax(logits), embedding
        return softmax(self.model.run(x)), None

    def explained(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """``scores`` and the class activation maps [N,classes,h,w] of the same run (the
        plain answer asks ONNX Runtime for none: only an explaining request pays for them)."""
        self._check_shape(pixels)
        self.metrics.batch_size.observe(pixels.shape[0])
        wants = self.observer is not None and self.observer.wants_embedding
        logits, embedding, cam = self.model.run_with_cam(
            model_input(pixels, self.card), embedding=wants
        )
        return softmax(logits), embedding, cam

    def check_explainable(self) -> None:
        """Refuse (400, field ``explain``) an explaining request to a model without ``cam``."""
        if self.explain_method is None:
            raise Refused(
                400,
                f"explain: this model (version {self.version}) was exported without its class "
                "activation map output 'cam' (no 'explain' in its ONNX metadata), so it cannot "
                "show what its answer looked at; re-export it with this trainyard "
                "(dvc repro export), or ask without explain",
                field="explain",
                reason="cannot_explain",
            )

    def _check_shape(self, pixels: np.ndarray) -> None:
        if pixels.ndim != 4 or pixels.shape[1:] != self.card.input_shape:
            raise ValueError(
                f"pixels must be [N,{','.join(map(str, self.card.input_shape))}], "
                f"got {list(pixels.shape)}"
            )

    def observe(
        self,
        route: str,
        answer: dict[str, Any],
        start: float,
        info: dict[str, Any],
        **seen: Any,
    ) -> None:
        """Hand an answered image to the observer (when on): queued, never waited for."""
        if self.observer is None:
            return
        latency_ms = (time.perf_counter() - start) * 1e3
        if not self.observer.keeps_images:
            seen.pop("image", None)
        self.observer.seen(Seen(route, answer, self.registry_version, latency_ms, info, **seen))

    def prediction(self, probs: np.ndarray | Sequence[float], top_k: int) -> dict[str, Any]:
        """The answer for one image: top-1 label, every probability, the top ``top_k``."""
        probs = np.asarray(probs)
        order = np.argsort(-probs, kind="stable")[:top_k]
        best = int(order[0])
        label = self.classes[best]
        self.metrics.predictions.labels(label=label).inc()
        self.metrics.confidence.observe(float(probs[best]))
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

    def decode(
        self, data: bytes, field: str, invert: bool, info: dict[str, Any] | None = None
    ) -> np.ndarray:
        """Image bytes -> uint8 [C,H,W] by the card (the function prepare used); ``info``
        receives the upload's format, width and height."""
        info = {} if info is None else info
        try:
            return decode_image(
                data,
                self.card,
                invert=invert,
                max_pixels=self.params.max_image_pixels,
                field=field,
                info=info,
                max_aspect_ratio=self.params.max_aspect_ratio,
            )
        except InputError as err:
            reason = "image_too_large" if err.status == 413 else "bad_image"
            raise Refused.from_input(err, reason) from None
        finally:
            if "width" in info:
                self.metrics.image_pixels.observe(info["width"] * info["height"])

    # ------------------------------------------------------------------ answers

    async def classify(
        self, image: bytes, top_k: int, invert: bool, explain: bool = False
    ) -> dict[str, Any]:
        """One image's answer (``explain``: with its heatmap; ``check_explainable`` first).
        Decode and inference inline, for a small upload when the start-up chose it, else in
        one worker-thread hop (each hop costs a GIL handoff)."""
        if self.inline_images and len(image) <= SMALL_UPLOAD_BYTES:
            return self._classify_now(image, top_k, invert, explain)
        return await self.in_thread(self._classify_now, image, top_k, invert, explain)

    def _classify_now(
        self, image: bytes, top_k: int, invert: bool, explain: bool = False
    ) -> dict[str, Any]:
        start, info = time.perf_counter(), {}
        pixels = self.decode(image, "image", invert, info)
        if explain:
            probs, embedding, cam = self.explained(pixels[None].astype(np.float32))
        else:
            probs, embedding = self.scores(pixels[None].astype(np.float32))
        answer = self.prediction(probs[0], top_k)
        self.observe(
            "/classify",
            answer,
            start,
            info,
            embedding=None if embedding is None else embedding[0],
            pixels=pixels,
            image=image,
            invert=invert,
        )
        if explain:  # after: the log sees the prediction (and its latency) as without
            return self._with_heatmap(answer, cam[0], info)
        return answer

    def _with_heatmap(
        self, answer: dict[str, Any], cam: np.ndarray, info: dict[str, Any]
    ) -> dict[str, Any]:
        """``answer`` and its ``heatmap``: the top class's map of ``cam`` [classes,h,w] over
        the upload ``info`` describes (decode's: its size, its EXIF turn), base64 PNG."""
        heat = upload_heatmap(cam[answer["class_id"]], self.card, info)
        return {**answer, "heatmap": base64.b64encode(heatmap_png(heat)).decode("ascii")}

    async def decode_one(
        self, image: bytes, invert: bool, info: dict[str, Any] | None = None
    ) -> np.ndarray:
        """One image -> uint8 [C,H,W], on a worker thread (before the adaptive batcher:
        the decodes of the next batch overlap the model call of this one)."""
        if self._decoders is None:  # its own: a batch never waits behind queued decodes
            self._decoders = anyio.CapacityLimiter(self.params.concurrent_inferences())
        call = functools.partial(self.decode, image, "image", invert, info)
        return await anyio.to_thread.run_sync(call, limiter=self._decoders)  # type: ignore[no-any-return]

    def classify_decoded(
        self, pixels: Sequence[np.ndarray], asks: Sequence[Any]
    ) -> list[dict[str, Any]]:
        """Decoded images (uint8 [C,H,W]) of concurrent /classify requests, the adaptive
        batcher's batch, through ONNX Runtime at once: one answer each. ``asks`` give each
        request's ``top_k``, ``explain`` and, for the prediction log and the heatmap,
        ``image``, ``invert``, ``info`` (the upload's format and size) and ``start``. The
        maps are asked of ONNX Runtime only when a request of the batch explains."""
        batch = np.stack(pixels).astype(np.float32)
        cam = None
        if any(ask.explain for ask in asks):
            probs, embeddings, cam = self.explained(batch)
        else:
            probs, embeddings = self.scores(batch)
        answers = []
        for row, ask in enumerate(asks):
            answer = self.prediction(probs[row], ask.top_k)
            embedding = None if embeddings is None else embeddings[row]
            seen = {"pixels": pixels[row], "image": ask.image, "invert": ask.invert}
            self.observe("/classify", answer, ask.start, ask.info, embedding=embedding, **seen)
            if ask.explain and cam is not None:
                answer = self._with_heatmap(answer, cam[row], ask.info)
            answers.append(answer)
        return answers

    async def classify_batch(
        self, images: Sequence[bytes] | np.ndarray, top_k: int, invert: bool
    ) -> list[dict[str, Any]]:
        """Encoded images (decoded here, by the card) or pixels [N,C,H,W] -> one answer each."""
        start = time.perf_counter()
        infos: list[dict[str, Any]] = [{} for _ in images]
        if isinstance(images, np.ndarray):
            pixels = images
        else:
            pixels = await self.in_thread(self._decode_all, images, invert, infos)
        probs, embeddings = await self.in_thread(self.scores, pixels)
        answers = [self.prediction(row, top_k) for row in probs]
        for i, answer in enumerate(answers if self.observer is not None else ()):
            self.observe(
                "/classify_batch",
                answer,
                start,
                infos[i],
                embedding=None if embeddings is None else embeddings[i],
                pixels=pixels[i].astype(np.uint8),
                image=None if isinstance(images, np.ndarray) else images[i],
                invert=invert,
            )
        return answers

    def _decode_all(
        self, files: Sequence[bytes], invert: bool, infos: list[dict[str, Any]]
    ) -> np.ndarray:
        c, h, w = self.card.input_shape
        out = np.empty((len(files), c, h, w), dtype=np.float32)
        for i, data in enumerate(files):
            out[i] = self.decode(data, f"images[{i}]", invert, infos[i])
        return out

    def describe(self) -> dict[str, Any]:
        """What GET /metadata answers: the model's identity, contract and provider."""
        meta = self.model.metadata
        p = self.params
        return {
            "model": {
                "path": str(self.model_path),
                "sha256": self.sha256,
                "version": self.version,
                "precision": self.precision,
                "arch": meta.get("arch"),
                "trainyard_version": meta.get("trainyard_version"),
                "mlflow_run_id": meta.get("mlflow_run_id"),
                "data_sha256": meta.get("data_sha256"),
                "checkpoint_sha256": meta.get("checkpoint_sha256"),
                # The weights training started from (source, sha256, licence); null: scratch.
                "pretrained": json.loads(meta.get("pretrained") or "{}") or None,
            },
            "classes": self.classes,
            # /classify?explain=1's method ("cam", "gradcam"); null: this model cannot.
            "explain": self.explain_method,
            # GET /card: evaluate's model card beside the model file; null: none shipped.
            "card": "/card" if card_beside(self.model_path, "json").is_file() else None,
            "dataset_card": self.card.contract(),
            "input": self._input_contract(),
            "endpoints": {
                "POST /classify": CLASSIFY_USAGE + "; query or form: top_k, invert, explain",
                "POST /classify_batch": BATCH_USAGE + "; query or form: top_k, invert",
                "GET /metadata": "this document",
                "GET /card": "the model card (Markdown; ?format=json for JSON)",
            },
            "source": self.provenance,
            "provider": self.model.provider,
            # True on CUDA: each call binds its batch on the device, only logits come back.
            "io_binding": self.model.io_binding,
            "device": p.device,
            "threads": {
                "onnxruntime_intra_op": p.model_threads(),
                "concurrent_inferences": p.concurrent_inferences(),
            },
            "batching": {
                "enabled": p.batching,
                "max_batch_size": p.max_batch_size,
                "max_latency_ms": p.max_latency_ms,
            },
        }

    def _input_contract(self) -> dict[str, Any]:
        c, p = self.card, self.params
        return {
            "shape": [-1, *c.input_shape],
            "image": image_shape_text(c),
            "dtype": self.model.metadata.get("input_dtype", "float32"),
            "normalization": {"scale": 255.0, "mean": list(c.mean), "std": list(c.std)},
            "resize": c.resize,
            "image_formats": list(IMAGE_FORMATS),
            "max_image_pixels": p.max_image_pixels,
            "max_batch_images": p.max_batch_images,
            "max_body_bytes": p.max_body_bytes,
            "max_aspect_ratio": p.max_aspect_ratio,
            "max_json_depth": p.max_json_depth,
            "max_json_values": p.max_json_values,
            "max_json_int_digits": p.max_json_int_digits,
            "top_k": p.top_k,
        }
