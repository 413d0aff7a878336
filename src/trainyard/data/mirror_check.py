"""Whether a dataset keeps its classes in a mirror: the measurement behind the recipe's
``augment`` choice (``trainyard.training.recipe.choose_augment``). Numpy only: a
nearest-class-mean classifier on the prepared splits, no model and no training."""

from __future__ import annotations

import os

import numpy as np

from trainyard.data.arrays import load_split


def mirror_keeps(data_dir: str | os.PathLike[str], limit: int = 10_000) -> tuple[float, float]:
    """(accuracy, accuracy on mirror images) of a nearest-class-mean classifier fitted on
    the train split and scored on the val split (each image centred and scaled to unit
    norm): how much of the classes survives a horizontal flip."""
    x, y = load_split(data_dir, "train")
    xv, yv = load_split(data_dir, "val")
    rng = np.random.default_rng(0)
    ti = np.sort(rng.permutation(len(y))[:limit])
    vi = np.sort(rng.permutation(len(yv))[: limit // 5])
    x, y, xv, yv = np.asarray(x[ti]), y[ti], np.asarray(xv[vi]), yv[vi]

    def unit(a: np.ndarray) -> np.ndarray:
        f = a.reshape(len(a), -1).astype(np.float32)
        f -= f.mean(axis=1, keepdims=True)
        return f / (np.linalg.norm(f, axis=1, keepdims=True) + 1e-6)

    f, classes = unit(x), np.unique(y)
    centres = np.stack([f[y == c].mean(axis=0) for c in classes])

    def accuracy(a: np.ndarray) -> float:
        return float((classes[np.argmax(unit(a) @ centres.T, axis=1)] == yv).mean())

    return accuracy(xv), accuracy(xv[..., ::-1])
