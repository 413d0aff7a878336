"""Watching the served model from inside the service: the prediction log and the shadow.

The answer path hands each answered image to ``Observer.seen``, which only queues: a
row for the prediction log (``trainyard.watch.log``), or, for the share of requests the
shadow scores, the decoded image for the shadow's thread. Neither ever waits: a full
queue drops (the log) or skips (the shadow), and /metrics counts it. The shadow's thread
scores with the challenger's own session, card and version, compares its top-1 with the
answer, and then logs the one row that carries both, so the log holds each request once.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.card import Card, card_from_metadata
from trainyard.core.config import DriftParams, ServeParams
from trainyard.core.errors import InputError
from trainyard.runtime.inputs import decode_image, model_input, softmax
from trainyard.runtime.sessions import OnnxModel
from trainyard.serve.drift_watch import DriftWatch
from trainyard.serve.metrics import Metrics, metrics
from trainyard.serve.settings import load_model, registry_label
from trainyard.watch.log import PredictionLog, utc_now

log = logging.getLogger("bentoml.serve.trainyard")


@dataclass
class Seen:
    """One answered image, as the observer gets it from the answer path."""

    route: str
    answer: Mapping[str, Any]  # the Predictor's prediction (label, class_id, top_k, ...)
    registry_version: str  # "NAME/N" or "local"
    latency_ms: float
    info: Mapping[str, Any]  # the upload's format, width, height (empty for pixel arrays)
    embedding: np.ndarray | None = None
    pixels: np.ndarray | None = None  # uint8 [C,H,W], as the answering model saw it
    image: bytes | None = None  # the upload, for the shadow's own decode and log_images
    invert: bool = False
    time: Any = field(default_factory=utc_now)


@dataclass
class ShadowAnswer:
    version: str
    registry_version: str
    label: str
    probability: float
    latency_ms: float


class ShadowModel:
    """The challenger: its own ONNX Runtime session, dataset card and version. Images reach
    it decoded by the answering model's card when both cards ask for the same input, else
    it decodes the upload by its own card."""

    def __init__(
        self, model: OnnxModel, sha256: str, registry_version: str, answering: Card, path: Path
    ) -> None:
        self.model, self.sha256 = model, sha256
        self.version, self.registry_version = sha256[:12], registry_version
        self.card: Card = card_from_metadata(model.metadata, str(path))
        self.classes = model.classes
        # Both cards ask for the same input: the answering model's decode serves the shadow.
        self.same_input = self.card.contract() == answering.contract()

    @classmethod
    def load(
        cls, path: Path, params: ServeParams, registry_version: str, answering: Card
    ) -> ShadowModel:
        # One thread: the shadow must leave the answer path's cores to the answers.
        model, sha = load_model(path, params.model_copy(update={"intra_op_threads": 1}))
        return cls(model, sha, registry_version, answering, path)

    def score(self, seen: Seen, params: ServeParams) -> ShadowAnswer | None:
        """The shadow's top-1 for ``seen``; None when it cannot see that input (pixel
        arrays sent for the answering model's contract, which is not its own)."""
        start = time.perf_counter()
        if self.same_input and seen.pixels is not None:
            pixels = seen.pixels
        elif seen.image is not None:
            try:
                pixels = decode_image(
                    seen.image,
                    self.card,
                    invert=seen.invert,
                    max_pixels=params.max_image_pixels,
                    max_aspect_ratio=params.max_aspect_ratio,
                )
            except InputError:
                return None
        else:
            return None
        batch = model_input(pixels[None].astype(np.float32), self.card)
        probs = softmax(self.model.run(batch))[0]
        best = int(probs.argmax())
        return ShadowAnswer(
            self.version,
            self.registry_version,
            self.classes[best],
            float(probs[best]),
            (time.perf_counter() - start) * 1e3,
        )


class Observer:
    """The prediction log and the shadow of one worker process (``close`` at shutdown)."""

    def __init__(
        self,
        params: ServeParams,
        metrics: Metrics,
        prediction_log: PredictionLog | None = None,
        shadow: ShadowModel | None = None,
        drift: DriftWatch | None = None,
    ) -> None:
        self.params, self.metrics = params, metrics
        self.log, self.shadow, self.drift = prediction_log, shadow, drift
        # The series' children, looked up once: seen() runs on every answer.
        self._answer_seconds = metrics.model_latency.labels(role="answer")
        if shadow is not None:  # no shadow: no empty shadow series on /metrics
            self._shadow_seconds = metrics.model_latency.labels(role="shadow")
        self._queue: queue.Queue[Seen | None] = queue.Queue(params.shadow_queue)
        self._thread: threading.Thread | None = None
        if shadow is not None:
            self._thread = threading.Thread(target=self._shadow_loop, name="shadow", daemon=True)
            self._thread.start()

    @property
    def wants_embedding(self) -> bool:
        """Whether the answering model's embedding is used (the log keeps it, drift reads it)."""
        return self.log is not None or self.drift is not None

    @property
    def keeps_images(self) -> bool:
        """Whether ``seen`` needs the upload's bytes (the shadow decodes, or the log keeps)."""
        return self.params.log_images or (self.shadow is not None and not self.shadow.same_input)

    def describe(self) -> str:
        """For the start-up line: where the log goes, which shadow runs on which share."""
        parts = []
        if self.drift is not None:
            parts.append(
                f"drift of the last {self.params.drift_window} answers every "
                f"{self.params.drift_every_s:g} s on /metrics"
            )
        if self.log is not None:
            parts.append(f"prediction log to {self.log.folder}")
        if self.shadow is not None:
            s = self.shadow
            parts.append(
                f"shadow {s.registry_version} (sha256 {s.sha256[:12]}) on "
                f"{self.params.shadow_share:.0%} of requests"
            )
        return ", ".join(parts)

    def seen(self, item: Seen) -> None:
        """On the answer path: queue, never wait."""
        self._answer_seconds.observe(item.latency_ms / 1e3)
        if self.drift is not None:
            answer = item.answer
            probability = answer["probabilities"][answer["class_id"]]
            self.drift.add(answer["label"], probability, item.embedding)
        if self.shadow is not None and random.random() < self.params.shadow_share:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                self.metrics.shadow_skipped.inc()
        self._log(item, None)

    def model_changed(self, sha256: str, reference: Path | None, drift: DriftParams) -> None:
        """The served model was swapped (a moved alias): the log and the shadow go on; the
        drift window restarts against the new model's reference (none: no drift score)."""
        if self.drift is None and reference is None:
            return
        if self.drift is not None:
            self.drift.close()
        self.drift = None
        if reference is not None and self.params.drift_window > 0:
            p = self.params
            self.drift = DriftWatch.load(reference, sha256, drift, p.drift_window, p.drift_every_s)

    def close(self) -> None:
        """Stop the shadow's thread (what it holds is scored first) and flush the log."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(30)
            self._thread = None
        if self.log is not None:
            self.log.close()
        if self.drift is not None:
            self.drift.close()

    def _shadow_loop(self) -> None:
        assert self.shadow is not None
        while (item := self._queue.get()) is not None:
            try:
                answer = self.shadow.score(item, self.params)
            except Exception:  # a shadow that fails must never take the worker down
                log.exception("trainyard: the shadow model failed on a request")
                answer = None
            if answer is not None:
                agree = answer.label == item.answer["label"]
                self.metrics.shadow_predictions.labels(agreement=str(agree).lower()).inc()
                self._shadow_seconds.observe(answer.latency_ms / 1e3)
            self._log(item, answer)

    def _log(self, item: Seen, shadow: ShadowAnswer | None) -> None:
        # The row is made on the log's writer thread (its convert), not here.
        if self.log is not None:
            self.log.offer((item, shadow))


def open_log(folder: Path, params: ServeParams, metrics: Metrics) -> PredictionLog:
    """This worker's prediction log in ``folder``, started, counting on /metrics."""

    def count(outcome: str, rows: int) -> None:
        metrics.log_rows.labels(outcome=outcome).inc(rows)

    return PredictionLog(
        folder,
        rotate_rows=params.log_rotate_rows,
        rotate_s=params.log_rotate_s,
        max_bytes=params.log_max_bytes,
        queue_rows=params.log_queue_rows,
        listener=count,
        convert=lambda pair: log_row(*pair, params),
    ).start()


def log_row(item: Seen, shadow: ShadowAnswer | None, params: ServeParams) -> dict[str, Any]:
    """The prediction log's row for one answered image (watch.log.SCHEMA's columns)."""
    answer, info = item.answer, item.info
    ranked = answer.get("top_k") or []
    keep = params.log_images and item.image is not None
    keep = keep and len(item.image or b"") <= params.log_image_max_bytes
    row: dict[str, Any] = {
        "time": item.time,
        "route": item.route,
        "model_version": answer.get("model_version"),
        "registry_version": item.registry_version,
        "label": answer["label"],
        "class_id": answer["class_id"],
        "probability": float(answer["probabilities"][answer["class_id"]]),
        "top_k_labels": [r["label"] for r in ranked],
        "top_k_probs": [r["probability"] for r in ranked],
        "width": info.get("width"),
        "height": info.get("height"),
        "format": info.get("format"),
        "latency_ms": item.latency_ms,
        "embedding": item.embedding,  # an array: watch.log builds the column from it
        "image": item.image if keep else None,
    }
    if shadow is not None:
        row.update(
            shadow_model_version=shadow.version,
            shadow_registry_version=shadow.registry_version,
            shadow_label=shadow.label,
            shadow_probability=shadow.probability,
            shadow_latency_ms=shadow.latency_ms,
        )
    return row


def build_observer(
    params: ServeParams,
    answering: Card,
    answering_sha256: str,
    log_dir: Path | None,
    shadow: tuple[Path, Mapping[str, str]] | None,
    reference: Path | None = None,
    drift: DriftParams | None = None,
) -> Observer | None:
    """This worker's observer for the served model (its card and sha256): the prediction
    log in ``log_dir`` (None: off), the shadow
    model (path, provenance; None: none) and the drift score against the ``reference``
    file (None, or serve.drift_window 0: off). None when none of them is on."""
    watch = None
    if reference is not None and params.drift_window > 0:
        watch = DriftWatch.load(
            reference,
            answering_sha256,
            drift or DriftParams(),
            params.drift_window,
            params.drift_every_s,
        )
    if log_dir is None and shadow is None and watch is None:
        return None
    found = metrics()
    challenger = None
    if shadow is not None:
        path, source = shadow
        challenger = ShadowModel.load(path, params, registry_label(source), answering)
    prediction_log = None if log_dir is None else open_log(log_dir, params, found)
    return Observer(params, found, prediction_log, challenger, watch)
