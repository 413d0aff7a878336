"""Evaluate stage: the *exported ONNX model* on the full test set, as it will be served.

The model's dataset card (its ONNX metadata) says what the input is and how to normalise
it, and names the classes: evaluate re-derives none of it. The test set may be far larger
than memory as float (a 15 GB uint8 memmap is 60 GB as float32), so pixels are normalised
one batch at a time and only the argmax of each batch is kept.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import unicodedata
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
from matplotlib import font_manager
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torchmetrics.functional.classification import (
    multiclass_accuracy,
    multiclass_confusion_matrix,
    multiclass_f1_score,
    multiclass_precision,
    multiclass_recall,
)

from trainyard.core.card import card_from_metadata, normalize_pixels
from trainyard.core.errors import DataError, ModelError
from trainyard.core.io import atomic_write_bytes, atomic_write_text
from trainyard.runtime.sessions import Device, OnnxModel, load_onnx


def classification_metrics(
    y_true: np.ndarray, y_pred: np.ndarray, classes: list[str]
) -> dict[str, Any]:
    """Accuracy, per-class precision/recall/F1 and the confusion matrix (torchmetrics)."""

    t, p, k = torch.from_numpy(y_true), torch.from_numpy(y_pred), len(classes)
    per_class = {
        "precision": multiclass_precision(p, t, k, average=None),
        "recall": multiclass_recall(p, t, k, average=None),
        "f1": multiclass_f1_score(p, t, k, average=None),
    }
    return {
        "accuracy": float(multiclass_accuracy(p, t, k, average="micro")),
        "macro_f1": float(multiclass_f1_score(p, t, k, average="macro")),
        "per_class": {
            name: {m: round(float(v[i]), 6) for m, v in per_class.items()}
            | {"support": int((y_true == i).sum())}
            for i, name in enumerate(classes)
        },
        "confusion_matrix": multiclass_confusion_matrix(p, t, k).tolist(),
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

TICK_LABEL_CHARS = 24
MAX_FIGURE_INCHES = 30.0
MAX_FIGURE_PIXELS = 3000  # per side: a 30 in figure at 100 dpi, a PNG of a few MB at most
ANNOTATE_MAX_CLASSES = 30  # above this, numbers in the cells are unreadable
MIN_TICK_POINTS = (
    5.0  # 7 px at 100 dpi; below this, label every n-th class instead of shrinking further
)
# Fonts tried after DejaVu Sans for glyphs it lacks (CJK, mostly), used where installed.
_FALLBACK_FONTS = (
    "Noto Sans CJK JP",
    "Noto Sans CJK SC",
    "Noto Sans CJK TC",
    "Noto Sans CJK KR",
    "Source Han Sans",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "IPAGothic",
    "Noto Sans",
    "Arial Unicode MS",
)


def tick_label(name: str, limit: int = TICK_LABEL_CHARS) -> str:
    """A class name fit for an axis: one line, at most ``limit`` characters."""
    # Newlines and tabs would make multi-line ticks that overlap their neighbours.
    text = " ".join(name.split())
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _font_families() -> list[str]:

    installed = {f.name for f in font_manager.fontManager.ttflist}
    # Only installed ones: naming a missing family makes matplotlib log a warning per text.
    return ["DejaVu Sans", *(f for f in _FALLBACK_FONTS if f in installed)]


def confusion_png(matrix: list[list[int]], classes: list[str], title: str) -> bytes:
    """The confusion matrix as a PNG, legible from 2 to a few hundred classes.

    Colour is the share of each actual class's images (row-normalised, so the diagonal is
    the recall), which keeps small and large classes on one scale; cells show counts only
    up to ``ANNOTATE_MAX_CLASSES`` classes.
    """

    cm = np.asarray(matrix, dtype=np.int64)
    k = len(classes)
    if cm.shape != (k, k):
        raise ValueError(f"confusion matrix is {cm.shape}, expected ({k}, {k}) for the classes")
    support = cm.sum(axis=1, keepdims=True)
    share = np.divide(cm, support, out=np.zeros(cm.shape), where=support > 0)

    # The figure grows with the class count up to MAX_FIGURE_INCHES; ~3.5 in go to the tick
    # labels, the colour bar and the title, the rest is the grid.
    side = min(MAX_FIGURE_INCHES, max(8.0, 3.5 + 0.25 * k))
    dpi = min(110.0, MAX_FIGURE_PIXELS / side)
    cell_pt = (side - 3.5) * 72 / k
    tick_pt = min(9.0, 0.7 * cell_pt)
    stride = 1 if tick_pt >= MIN_TICK_POINTS else math.ceil(MIN_TICK_POINTS / tick_pt)
    tick_pt = max(tick_pt, MIN_TICK_POINTS)
    ticks = list(range(0, k, stride))
    labels = [tick_label(classes[i]) for i in ticks]
    annotate = k <= ANNOTATE_MAX_CLASSES
    what = "colour: share of each actual class (row-normalised; diagonal = recall)"
    if annotate:
        what += "; numbers: image counts"
    if stride > 1:
        what += f"; one class in {stride} labelled"

    # A private Figure + Agg canvas, not pyplot: no global backend switch, no figure left
    # open if anything fails, safe beside other threads' plots.
    rc = {"text.usetex": False, "font.family": _font_families()}
    with matplotlib.rc_context(rc), warnings.catch_warnings():
        # A glyph no installed font has (CJK without a CJK font) is drawn as a box; the
        # per-glyph warning would only repeat that for every class name.
        warnings.filterwarnings("ignore", message=r"Glyph .* missing from", category=UserWarning)
        fig = Figure(figsize=(side, side), dpi=dpi, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        im = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
        # parse_math=False: a "$" in a class name must stay a dollar sign, not start TeX.
        xrot = {"rotation": 90, "ha": "center"} if k > 12 else {"rotation": 45, "ha": "right"}
        ax.set_xticks(ticks, labels, fontsize=tick_pt, parse_math=False, **xrot)
        ax.set_yticks(ticks, labels, fontsize=tick_pt, parse_math=False)
        # Title and axis names grow a little with the figure so they stay findable.
        head_pt = min(16.0, 10.0 * math.sqrt(side / 8.0))
        ax.set_xlabel("predicted", fontsize=head_pt)
        ax.set_ylabel("actual", fontsize=head_pt)
        ax.set_title(f"{title}\n{what}", parse_math=False, fontsize=head_pt)
        if annotate:
            digits = len(str(int(cm.max(initial=0))))
            number_pt = max(4.0, min(8.0, cell_pt / (0.65 * max(digits, 2) + 0.6)))
            for i, j in np.ndindex(cm.shape):
                ax.text(
                    j,
                    i,
                    str(cm[i, j]),
                    ha="center",
                    va="center",
                    fontsize=number_pt,
                    color="white" if share[i, j] > 0.5 else "black",
                )
        # About 0.4 in wide at any figure size (a fixed fraction would be 1.4 in at 30 in).
        bar = fig.colorbar(
            im, ax=ax, fraction=min(0.046, 0.4 / side), pad=0.01, aspect=max(20.0, 2.5 * side)
        )
        bar.set_label("share of the actual class", fontsize=head_pt)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    return buf.getvalue()


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
) -> np.ndarray:
    """Argmax class (int64 ``[N]``) of each image, normalising one batch at a time."""
    n = images.shape[0]
    preds = np.empty(n, dtype=np.int64)

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
            logits = model.run(x)
            if logits.ndim != 2 or logits.shape != (x.shape[0], num_classes):
                raise ModelError(
                    f"the model returned {logits.shape} for a batch of {x.shape[0]}; its card "
                    f"names {num_classes} classes, so [{x.shape[0]}, {num_classes}] was "
                    "expected. Re-export it with `dvc repro export`"
                )
            preds[start : start + x.shape[0]] = logits.argmax(axis=1)
    return preds


def evaluate_onnx(
    onnx_path: str | os.PathLike[str],
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    device: Device = "auto",
) -> dict[str, Any]:
    """Run the ONNX model on uint8 images ``[N, C, H, W]`` with integer labels ``[N]``.

    ``images`` may be a read-only memmap of any size: it is read and normalised one batch
    at a time. Returns ``{"metrics": {..., "samples", "provider"}, "predictions": int64
    [N], "classes": the card's class names}``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    model = load_onnx(onnx_path, device=device)
    card = card_from_metadata(model.metadata, str(onnx_path))
    classes = list(card.classes)
    if images.dtype != np.uint8:
        raise DataError(f"test images are {images.dtype}, expected uint8 pixels 0..255")
    if images.ndim != 4 or tuple(images.shape[1:]) != card.input_shape:
        raise DataError(
            f"test images are {tuple(images.shape[1:])} (C, H, W) each, but the model's card "
            f"says {card.input_shape}: the data and the model come from different "
            "preparations; rerun `dvc repro`"
        )
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"test labels must be integers [N], got {labels.dtype} {labels.shape}")
    if labels.shape[0] != images.shape[0]:
        raise DataError(f"{images.shape[0]} test images but {labels.shape[0]} labels")
    if labels.shape[0] == 0:
        raise DataError("the test set is empty; nothing to evaluate")
    if labels.max() >= len(classes) or labels.min() < 0:
        raise DataError(
            f"test labels go from {labels.min()} to {labels.max()}, "
            f"model has {len(classes)} classes"
        )
    preds = _predict(model, images, card.mean, card.std, batch_size, len(classes))
    metrics = classification_metrics(labels.astype(np.int64), preds, classes)
    metrics["samples"] = int(labels.shape[0])
    metrics["provider"] = model.provider
    return {"metrics": metrics, "predictions": preds, "classes": classes, "card": card}


def write_reports(
    result: dict[str, Any],
    labels: np.ndarray,
    reports_dir: str | os.PathLike[str],
) -> dict[str, Path]:
    """predictions.csv, confusion_matrix.png and classification_report.json into
    ``reports_dir`` (each atomically); returns their paths by name."""
    reports_dir = Path(reports_dir)
    m, classes = result["metrics"], result["classes"]
    paths = {
        "predictions": reports_dir / "predictions.csv",
        "confusion_png": reports_dir / "confusion_matrix.png",
        "classification": reports_dir / "classification_report.json",
    }
    atomic_write_text(paths["predictions"], predictions_csv(labels, result["predictions"], classes))
    atomic_write_bytes(
        paths["confusion_png"],
        confusion_png(
            m["confusion_matrix"],
            classes,
            f"ONNX model on {m['samples']} test images — accuracy {m['accuracy']:.4f}",
        ),
    )
    # ensure_ascii=False: class names stay readable ("crème brûlée"); the file is UTF-8.
    atomic_write_text(paths["classification"], json.dumps(m, indent=2, ensure_ascii=False) + "\n")
    return paths
