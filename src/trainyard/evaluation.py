"""Evaluate stage: the *exported ONNX model* on the full test set, as it will be served."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.errors import DataError
from trainyard.inference import Device, load_onnx
from trainyard.io import atomic_write_bytes, atomic_write_text
from trainyard.preprocess import InputContract, normalize


def classification_metrics(
    y_true: np.ndarray, y_pred: np.ndarray, classes: list[str]
) -> dict[str, Any]:
    """Accuracy, per-class precision/recall/F1 and the confusion matrix (torchmetrics)."""
    import torch
    from torchmetrics.functional.classification import (
        multiclass_accuracy,
        multiclass_confusion_matrix,
        multiclass_f1_score,
        multiclass_precision,
        multiclass_recall,
    )

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


def confusion_png(matrix: list[list[int]], classes: list[str], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    cm = np.asarray(matrix)
    fig, ax = plt.subplots(figsize=(8, 7), dpi=110)
    im = ax.imshow(cm, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("actual")
    ax.set_title(title)
    for i in range(cm.shape[0]):
        for j in range(cm.shape[1]):
            ax.text(
                j,
                i,
                str(cm[i, j]),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if cm[i, j] > cm.max() / 2 else "black",
            )
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def predictions_csv(y_true: np.ndarray, y_pred: np.ndarray, classes: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["actual", "predicted"])
    writer.writerows((classes[a], classes[b]) for a, b in zip(y_true, y_pred, strict=True))
    return buf.getvalue()


def evaluate_onnx(
    onnx_path: str | os.PathLike[str],
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    device: Device = "auto",
) -> dict[str, Any]:
    """Run the ONNX model on uint8 images [N,H,W]; return metrics + provider + predictions."""
    model = load_onnx(onnx_path, device=device)
    classes = model.classes
    if labels.max(initial=0) >= len(classes):
        raise DataError(f"test labels go up to {labels.max()}, model has {len(classes)} classes")
    x = normalize(images, InputContract.from_metadata(model.metadata))
    preds = model.predict_logits(x, batch_size=batch_size).argmax(1)
    metrics = classification_metrics(labels.astype(np.int64), preds.astype(np.int64), classes)
    metrics["samples"] = int(labels.shape[0])
    metrics["provider"] = model.provider
    return {"metrics": metrics, "predictions": preds, "classes": classes}


def write_reports(
    result: dict[str, Any],
    labels: np.ndarray,
    reports_dir: str | os.PathLike[str],
) -> dict[str, Path]:
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
    atomic_write_text(paths["classification"], json.dumps(m, indent=2) + "\n")
    return paths
