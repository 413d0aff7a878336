"""Prepare stage: IDX -> compact uint8 arrays with a seeded, stratified validation split."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainyard.dataset import CLASS_NAMES, IMAGE_SIZE, NUM_CLASSES, RAW_BY_NAME
from trainyard.idx import check_images, check_labels, read_idx
from trainyard.io import atomic_dir, atomic_write_json

if TYPE_CHECKING:  # pydantic stays out of the light paths (bench, gpu-check)
    from trainyard.config import DataParams

SPLITS = ("train", "val", "test")
STATS_FILE = "stats.json"


def load_raw(raw_dir: str | os.PathLike[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read and validate the raw IDX files: {'train': (images, labels), 'test': (...)}."""
    raw_dir = Path(raw_dir)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        img_name, lbl_name = f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz"
        images = read_idx(raw_dir / img_name)
        labels = read_idx(raw_dir / lbl_name)
        check_images(images, str(raw_dir / img_name), RAW_BY_NAME[img_name].count, IMAGE_SIZE)
        check_labels(labels, str(raw_dir / lbl_name), NUM_CLASSES, RAW_BY_NAME[lbl_name].count)
        out[split] = (images, labels)
    return out


def _per_class_quota(labels: np.ndarray, total: int) -> np.ndarray:
    """How many of ``total`` to take from each class, proportional to class frequency."""
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    exact = counts / counts.sum() * total
    quota = np.floor(exact).astype(np.int64)
    # Hand out the remainder to the largest fractional parts: sums exactly to ``total``.
    for c in np.argsort(-(exact - quota), kind="stable")[: total - quota.sum()]:
        quota[c] += 1
    return np.minimum(quota, counts)


def stratified_take(labels: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of a stratified random sample of ``total`` items (sorted)."""
    quota = _per_class_quota(labels, total)
    picked = [rng.permutation(np.flatnonzero(labels == c))[: quota[c]] for c in range(NUM_CLASSES)]
    return np.sort(np.concatenate(picked))


def split_train_val(
    labels: np.ndarray, val_size: int, limit: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of the train file into (train_idx, val_idx)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(labels.shape[0])
    if limit is not None and limit < labels.shape[0]:
        pool = stratified_take(labels, limit, rng)
    val_local = stratified_take(labels[pool], val_size, rng)
    mask = np.ones(pool.shape[0], dtype=bool)
    mask[val_local] = False
    return pool[mask], pool[val_local]


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def prepare(
    raw_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], params: DataParams, seed: int
) -> dict[str, Any]:
    """Write {train,val,test}_{images,labels}.npy and stats.json to ``out_dir`` atomically."""
    raw = load_raw(raw_dir)
    train_images, train_labels = raw["train"]
    train_idx, val_idx = split_train_val(train_labels, params.val_size, params.limit, seed)
    arrays = {
        "train": (train_images[train_idx], train_labels[train_idx]),
        "val": (train_images[val_idx], train_labels[val_idx]),
        "test": raw["test"],
    }
    train_x = arrays["train"][0]
    # Normalisation constants from the training split only (no peeking at val/test).
    mean = float(train_x.mean(dtype=np.float64) / 255.0)
    std = float(train_x.std(dtype=np.float64) / 255.0)
    digest = hashlib.sha256()
    stats: dict[str, Any] = {
        "classes": list(CLASS_NAMES),
        "image_size": IMAGE_SIZE,
        "pixel_mean": round(mean, 6),
        "pixel_std": round(std, 6),
        "seed": seed,
        "limit": params.limit,
        "counts": {},
    }
    with atomic_dir(out_dir) as tmp:
        for split in SPLITS:
            images, labels = arrays[split]
            for kind, arr in (("images", images), ("labels", labels)):
                blob = _npy_bytes(np.ascontiguousarray(arr, dtype=np.uint8))
                digest.update(blob)
                (tmp / f"{split}_{kind}.npy").write_bytes(blob)
            counts = np.bincount(labels, minlength=NUM_CLASSES)
            stats["counts"][split] = {
                "total": int(labels.shape[0]),
                "per_class": {CLASS_NAMES[c]: int(counts[c]) for c in range(NUM_CLASSES)},
            }
        stats["data_sha256"] = digest.hexdigest()
        atomic_write_json(tmp / STATS_FILE, stats)
    return stats
