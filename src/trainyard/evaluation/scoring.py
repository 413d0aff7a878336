"""Evaluate stage: the *exported ONNX model* on the full test set, as it will be served.

The model's dataset card (its ONNX metadata) says what the input is and how to normalise
it, and names the classes: evaluate re-derives none of it. The test set may be far larger
than memory as float (a 15 GB uint8 memmap is 60 GB as float32), so pixels are normalised
one batch at a time and only the argmax of each batch is kept. On CUDA each batch goes
through ``OnnxModel.run``'s IO binding: it crosses the bus once, and only its logits
(batch x classes, a few KB) come back for the argmax and softmax.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import unicodedata
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.card import card_from_metadata, normalize_pixels
from trainyard.core.errors import DataError, ModelError
from trainyard.core.io import atomic_write_bytes, atomic_write_text
from trainyard.core.pause_points import pause_point
from trainyard.core.reliability import ECE_BINS, reliability
from trainyard.evaluation.deletion import deletion_note, explain_split
from trainyard.evaluation.pictures import (
    confusion_png,
    learning_curves_png,
    mistakes_png,
    per_class_png,
    reliability_png,
)
from trainyard.runtime.inputs import softmax
from trainyard.runtime.sessions import Device, OnnxModel, load_onnx

# What write_reports writes into the reports folder, by the name it returns each under.
REPORT_FILES = {
    "predictions": "predictions.csv",
    "classification": "classification_report.json",
    "confusion_png": "confusion_matrix.png",
    "confusion_normalized_png": "confusion_matrix_normalized.png",
    "per_class_png": "per_class.png",
    "mistakes_png": "mistakes.png",
    "curves_png": "learning_curves.png",
    "reliability_png": "reliability.png",
}


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0 (torchmetrics' ``zero_division=0``)."""
    return np.divide(num, den, out=np.zeros(len(num)), where=den > 0)


def classification_metrics(
    y_true: np.ndarray, y_pred: np.ndarray, classes: list[str]
) -> dict[str, Any]:
    """Accuracy, per-class precision/recall/F1 and the confusion matrix (rows: true class,
    columns: predicted), with torchmetrics' multiclass definitions: a ratio with nothing to
    divide by is 0, and the macro F1 averages over the classes seen in either labels or
    predictions. In numpy: the evaluate stage scores the ONNX model without importing torch."""
    k = len(classes)
    cm = np.bincount(
        np.asarray(y_true, np.int64) * k + np.asarray(y_pred, np.int64), minlength=k * k
    ).reshape(k, k)
    tp = np.diag(cm).astype(np.float64)
    fp, fn = cm.sum(axis=0) - tp, cm.sum(axis=1) - tp
    f1 = _ratio(2 * tp, 2 * tp + fp + fn)
    seen = (tp + fp + fn) > 0
    per_class = {"precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn), "f1": f1}
    return {
        "accuracy": float(tp.sum() / max(int(cm.sum()), 1)),
        "macro_f1": float(f1[seen].mean()) if seen.any() else 0.0,
        "per_class": {
            name: {m: round(float(v[i]), 6) for m, v in per_class.items()}
            | {"support": int(cm[i].sum())}
            for i, name in enumerate(classes)
        },
        "confusion_matrix": cm.tolist(),
    }


def calibration_metrics(
    labels: np.ndarray, preds: np.ndarray, confidence: np.ndarray, raw: np.ndarray, t: float
) -> dict[str, Any]:
    """The temperature the graph carries, and the reliability of the confidences with it
    (``calibrated``) and without it (``uncalibrated``: softmax of logits x t)."""
    correct = preds == labels
    return {
        "temperature": t,
        "bins": ECE_BINS,
        "calibrated": reliability(confidence, correct),
        "uncalibrated": reliability(raw, correct),
    }


# ---------------------------------------------------------------------------- MLflow keys

# What MLflow accepts in a metric key is [A-Za-z0-9_.- :/] (no colon on Windows); the slash
# makes a hierarchy in the UI, so a class name must not bring its own. Non-ASCII letters are
# accepted by MLflow's \w, but not by every tracking backend's file names: keep to ASCII.
_METRIC_UNSAFE = re.compile(r"[^A-Za-z0-9_.\- ]")
MAX_METRIC_KEY_LENGTH = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH


def metric_key(prefix: str, index: int, name: str, num_classes: int) -> str:
    """The MLflow metric key for class ``index`` (of ``num_classes``) called ``name``.

    ``metric_key("test/f1", 0, "T-shirt/top", 10)`` is ``"test/f1/00_T-shirt_top"``. The
    index, zero-padded to the width of the class count, makes keys unique even when two
    names sanitise to the same text, and makes them sort in class order. Accents are
    dropped (``crème`` -> ``creme``) before anything else outside ``[A-Za-z0-9_.- ]``
    becomes ``_``; the name is cut to keep the key within MLflow's 250 characters.
    """
    if not 0 <= index < num_classes:
        raise ValueError(f"class index {index} is outside 0..{num_classes - 1}")
    head = f"{prefix.rstrip('/')}/{index:0{len(str(num_classes))}d}_"
    if len(head) > MAX_METRIC_KEY_LENGTH:
        raise ValueError(f"metric key prefix {prefix!r} is too long for MLflow")
    # NFKD splits "è" into "e" + a combining accent, which the filter then drops.
    ascii_name = unicodedata.normalize("NFKD", name)
    ascii_name = "".join(c for c in ascii_name if not unicodedata.combining(c))
    clean = _METRIC_UNSAFE.sub("_", ascii_name).strip()
    return head + clean[: MAX_METRIC_KEY_LENGTH - len(head)].rstrip()


# ---------------------------------------------------------------------------- reports


def predictions_csv(y_true: np.ndarray, y_pred: np.ndarray, classes: list[str]) -> str:
    """``actual,predicted`` per test image, by class name (what `dvc plots` reads).

    Names with commas, quotes or newlines are quoted by the csv module. It does not quote a
    lone carriage return when the line ending is "\\n", so a name holding one would split its
    row on reading: then every field is quoted.
    """
    buf = io.StringIO()
    quoting = csv.QUOTE_ALL if any("\r" in c for c in classes) else csv.QUOTE_MINIMAL
    writer = csv.writer(buf, lineterminator="\n", quoting=quoting)
    writer.writerow(["actual", "predicted"])
    writer.writerows((classes[a], classes[b]) for a, b in zip(y_true, y_pred, strict=True))
    return buf.getvalue()


# ---------------------------------------------------------------------------- evaluation


def _predict(
    model: OnnxModel,
    images: np.ndarray,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    batch_size: int,
    num_classes: int,
    embedding_rows: np.ndarray | None = None,
    temperature: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Argmax class (int64 ``[N]``) of each image and its softmax probability (float32
    ``[N]``, the confidence the service reports), normalising one batch at a time; and the
    embeddings of the sorted ``embedding_rows`` only (None without rows, or for a model
    exported without its embedding output): a large test split's never sit in memory.
    Also the confidence without the graph's ``temperature`` (softmax of logits x it)."""
    n = images.shape[0]
    preds = np.empty(n, dtype=np.int64)
    confidence = np.empty(n, dtype=np.float32)
    raw = confidence if temperature == 1.0 else np.empty(n, dtype=np.float32)
    kept: list[np.ndarray] = []
    want = embedding_rows is not None and model.has_embedding

    def prepare(start: int) -> np.ndarray:
        # Slicing a memmap reads only this batch; normalize_pixels makes its float copy.
        return normalize_pixels(images[start : start + batch_size], mean, std)

    # One worker reads and normalises the next batch while ONNX Runtime (which releases
    # the GIL) runs this one: on a GPU the reading would otherwise leave it idle.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluate-prefetch") as pool:
        pending: Future[np.ndarray] | None = pool.submit(prepare, 0) if n else None
        for start in range(0, n, batch_size):
            assert pending is not None
            x = pending.result()
            nxt = start + batch_size
            pending = pool.submit(prepare, nxt) if nxt < n else None
            embedding = None
            if want:
                logits, embedding = model.run_with_embedding(x)
            else:
                logits = model.run(x)
            pause_point("evaluate.batch_scored")
            if embedding is not None:
                lo, hi = np.searchsorted(embedding_rows, [start, start + x.shape[0]])
                kept.append(np.asarray(embedding[embedding_rows[lo:hi] - start], np.float32))
            if logits.ndim != 2 or logits.shape != (x.shape[0], num_classes):
                raise ModelError(
                    f"the model returned {logits.shape} for a batch of {x.shape[0]}; its card "
                    f"names {num_classes} classes, so [{x.shape[0]}, {num_classes}] was "
                    "expected. Re-export it with `dvc repro export`"
                )
            preds[start : start + x.shape[0]] = logits.argmax(axis=1)
            confidence[start : start + x.shape[0]] = softmax(logits).max(axis=1)
            if raw is not confidence:
                raw[start : start + x.shape[0]] = softmax(logits * temperature).max(axis=1)
    return preds, confidence, raw, (np.concatenate(kept) if kept else None)


def evaluate_onnx(
    onnx_path: str | os.PathLike[str],
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    device: Device = "auto",
    embedding_rows: np.ndarray | None = None,
) -> dict[str, Any]:
    """Run the ONNX model on uint8 images ``[N, C, H, W]`` with integer labels ``[N]``.

    ``images`` may be a read-only memmap of any size: it is read and normalised one batch
    at a time. Returns ``{"metrics": {..., "samples", "provider", "io_binding"},
    "predictions": int64 [N], "confidence": float32 [N] (softmax probability of the
    prediction), "embeddings": float32 [len(embedding_rows), D] (the model's embedding of
    those test images, sorted row indices; None without rows or without the model's
    embedding output), "classes": the card's class names, "card", "heatmaps": test image
    index -> the predicted class's heatmap, for the worst mistakes (empty for a model
    without maps)}``; ``metrics["explain"]``: the deletion test (``evaluation.deletion``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    model = load_onnx(onnx_path, device=device)
    card = card_from_metadata(model.metadata, str(onnx_path))
    classes = list(card.classes)
    _check_test_set(images, labels, card.input_shape, len(classes))
    rows = None if embedding_rows is None else np.sort(np.asarray(embedding_rows, np.int64))
    # The temperature export baked into the graph (absent from older models: 1).
    temperature = float(model.metadata.get("temperature", 1.0))
    preds, confidence, raw, embeddings = _predict(
        model, images, card.mean, card.std, batch_size, len(classes), rows, temperature
    )
    metrics = classification_metrics(labels.astype(np.int64), preds, classes)
    metrics["calibration"] = calibration_metrics(labels, preds, confidence, raw, temperature)
    deletion, heatmaps = explain_split(model, images, labels, preds, confidence, card, batch_size)
    if deletion is not None:  # a model exported before its maps has no deletion test
        metrics["explain"] = deletion
    metrics["samples"] = int(labels.shape[0])
    metrics["provider"] = model.provider
    metrics["io_binding"] = model.io_binding  # bound on the device (CUDA) or plain run
    return {
        "metrics": metrics,
        "predictions": preds,
        "confidence": confidence,
        "embeddings": embeddings,
        "classes": classes,
        "card": card,
        "metadata": model.metadata,  # the ONNX model's (arch, pretrained weights: the card's)
        "heatmaps": heatmaps,
    }


def _check_test_set(
    images: np.ndarray, labels: np.ndarray, input_shape: tuple[int, ...], n_classes: int
) -> None:
    """Refuse (DataError) test images and labels that do not fit the model's card."""
    if images.dtype != np.uint8:
        raise DataError(f"test images are {images.dtype}, expected uint8 pixels 0..255")
    if images.ndim != 4 or tuple(images.shape[1:]) != input_shape:
        raise DataError(
            f"test images are {tuple(images.shape[1:])} (C, H, W) each, but the model's card "
            f"says {input_shape}: the data and the model come from different "
            "preparations; rerun `dvc repro`"
        )
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"test labels must be integers [N], got {labels.dtype} {labels.shape}")
    if labels.shape[0] != images.shape[0]:
        raise DataError(f"{images.shape[0]} test images but {labels.shape[0]} labels")
    if labels.shape[0] == 0:
        raise DataError("the test set is empty; nothing to evaluate")
    if labels.max() >= n_classes or labels.min() < 0:
        raise DataError(
            f"test labels go from {labels.min()} to {labels.max()}, model has {n_classes} classes"
        )


def write_reports(
    result: dict[str, Any],
    images: np.ndarray,
    labels: np.ndarray,
    reports_dir: str | os.PathLike[str],
    history: list[dict[str, Any]] | None,
) -> dict[str, Path]:
    """``REPORT_FILES`` into ``reports_dir``, each atomically: the predictions, the metrics
    JSON and the pictures (``trainyard.evaluation.pictures``); returns their paths by name.

    ``images`` and ``labels`` are the test set ``result`` was computed on (only the images
    of the mistakes grid are read); ``history`` the fit's rows (None: a picture says so).
    """
    reports_dir = Path(reports_dir)
    m, classes = result["metrics"], result["classes"]
    preds = result["predictions"]
    paths = {name: reports_dir / file for name, file in REPORT_FILES.items()}
    atomic_write_text(paths["predictions"], predictions_csv(labels, preds, classes))
    # ensure_ascii=False: class names stay readable ("crème brûlée"); the file is UTF-8.
    atomic_write_text(paths["classification"], json.dumps(m, indent=2, ensure_ascii=False) + "\n")
    title = f"ONNX model on {m['samples']} test images — accuracy {m['accuracy']:.4f}"
    pictures = {
        "confusion_png": lambda: confusion_png(m["confusion_matrix"], classes, title),
        "confusion_normalized_png": lambda: confusion_png(
            m["confusion_matrix"], classes, title, normalize=True
        ),
        "per_class_png": lambda: per_class_png(m["per_class"], classes, title),
        "mistakes_png": lambda: mistakes_png(
            images,
            labels,
            preds,
            result["confidence"],
            classes,
            heatmaps=result.get("heatmaps"),
            note=deletion_note(m["explain"]) if "explain" in m else None,
        ),
        "curves_png": lambda: learning_curves_png(history, "Training history"),
        "reliability_png": lambda: reliability_png(
            {
                "as trained": m["calibration"]["uncalibrated"],
                f"temperature {m['calibration']['temperature']:g}": m["calibration"]["calibrated"],
            },
            f"Confidence vs accuracy on {m['samples']} test images",
        ),
    }
    for name, draw in pictures.items():
        atomic_write_bytes(paths[name], draw())
    return paths
