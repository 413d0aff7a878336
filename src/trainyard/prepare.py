"""Prepare stage: any source -> uint8 ``[N, C, H, W]`` arrays per split + the dataset card.

Sources (``trainyard.sources``) decide *what* goes into each split; this module owns *how*
it is written: memory-mapped arrays filled in place (peak memory does not grow with the
dataset), per-channel statistics from the train split in chunks, one hash of everything
written, and all of it inside a temp folder that replaces ``out_dir`` only when complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainyard.card import CARD_FILE, SPLITS, Card
from trainyard.io import atomic_dir, atomic_write_text

if TYPE_CHECKING:  # pydantic stays out of the light paths (bench, gpu-check)
    from trainyard.config import DataParams

LABEL_DTYPE = np.int32  # any class count (uint8 would stop at 256)
_STATS_CHUNK = 4096  # images per chunk for mean/std: bounded memory on any dataset


def per_class_quota(labels: np.ndarray, total: int, num_classes: int) -> np.ndarray:
    """How many of ``total`` to take from each class, proportional to class frequency."""
    counts = np.bincount(labels, minlength=num_classes)
    exact = counts / counts.sum() * total
    quota = np.floor(exact).astype(np.int64)
    # Hand out the remainder to the largest fractional parts: sums exactly to ``total``.
    for c in np.argsort(-(exact - quota), kind="stable")[: total - quota.sum()]:
        quota[c] += 1
    return np.minimum(quota, counts)


def stratified_take(
    labels: np.ndarray, total: int, rng: np.random.Generator, num_classes: int | None = None
) -> np.ndarray:
    """Indices of a stratified random sample of ``total`` items (sorted)."""
    k = int(labels.max(initial=0)) + 1 if num_classes is None else num_classes
    quota = per_class_quota(labels, total, k)
    picked = [rng.permutation(np.flatnonzero(labels == c))[: quota[c]] for c in range(k)]
    return np.sort(np.concatenate(picked))


def split_train_val(
    labels: np.ndarray, val_size: int, limit: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of a train pool into (train_idx, val_idx)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(labels.shape[0])
    if limit is not None and limit < labels.shape[0]:
        pool = stratified_take(labels, limit, rng)
    val_local = stratified_take(labels[pool], val_size, rng)
    mask = np.ones(pool.shape[0], dtype=bool)
    mask[val_local] = False
    return pool[mask], pool[val_local]


def class_counts(labels: np.ndarray, classes: tuple[str, ...]) -> dict[str, Any]:
    counts = np.bincount(labels, minlength=len(classes))
    return {
        "total": int(labels.shape[0]),
        "per_class": {name: int(counts[i]) for i, name in enumerate(classes)},
    }


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std on the 0..1 scale of uint8 ``[N, C, H, W]``, in chunks."""
    c = images.shape[1]
    total = np.zeros(c, dtype=np.float64)
    total_sq = np.zeros(c, dtype=np.float64)
    for start in range(0, images.shape[0], _STATS_CHUNK):
        chunk = np.asarray(images[start : start + _STATS_CHUNK], dtype=np.float64)
        total += chunk.sum(axis=(0, 2, 3))
        total_sq += np.square(chunk).sum(axis=(0, 2, 3))
    n = float(images.shape[0] * images.shape[2] * images.shape[3])
    mean = total / n
    std = np.sqrt(np.maximum(total_sq / n - mean**2, 0.0))
    std = np.where(std > 0, std, 255.0)  # a constant channel: keep the formula finite
    return tuple(round(float(m) / 255.0, 6) for m in mean), tuple(
        round(float(s) / 255.0, 6) for s in std
    )


class PreparedWriter:
    """The prepared folder being written: split arrays as memory maps in a temp folder.

    Use ``open_prepared(out_dir)``; only a writer whose block ends without an exception
    replaces ``out_dir``.
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def images_path(self, split: str) -> Path:
        return self.tmp / f"{split}_images.npy"

    def allocate(self, split: str, n: int, shape: tuple[int, int, int]) -> np.ndarray:
        """A writable uint8 memory map ``[n, C, H, W]`` for ``split`` (zero-filled)."""
        return np.lib.format.open_memmap(
            self.images_path(split), mode="w+", dtype=np.uint8, shape=(n, *shape)
        )

    def write_images(self, split: str, images: np.ndarray) -> None:
        np.save(self.images_path(split), np.ascontiguousarray(images, dtype=np.uint8))

    def write_labels(self, split: str, labels: np.ndarray) -> None:
        np.save(self.tmp / f"{split}_labels.npy", np.asarray(labels, dtype=LABEL_DTYPE))

    def images(self, split: str) -> np.ndarray:
        return np.load(self.images_path(split), mmap_mode="r")

    def labels(self, split: str) -> np.ndarray:
        return np.load(self.tmp / f"{split}_labels.npy")

    def digest(self) -> str:
        """sha256 over every array file, in split order: the prepared data's identity."""
        h = hashlib.sha256()
        for split in SPLITS:
            for kind in ("images", "labels"):
                with open(self.tmp / f"{split}_{kind}.npy", "rb") as fh:
                    while block := fh.read(1 << 22):
                        h.update(block)
        return h.hexdigest()

    def finish(self, card: Card) -> Card:
        """Counts, statistics and hash from what was written, then the card itself."""
        counts = {s: class_counts(self.labels(s), card.classes) for s in SPLITS}
        mean, std = channel_stats(self.images("train"))
        facts = {"counts": counts, "mean": mean, "std": std, "data_sha256": self.digest()}
        done = Card.from_dict(card.to_dict() | facts)
        atomic_write_text(self.tmp / CARD_FILE, done.to_json())
        return done


@contextlib.contextmanager
def open_prepared(out_dir: str | os.PathLike[str]) -> Iterator[PreparedWriter]:
    with atomic_dir(out_dir) as tmp:
        yield PreparedWriter(tmp)


def prepare(
    raw_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    params: DataParams,
    seed: int,
    max_image_pixels: int | None = None,
) -> Card:
    """Prepare ``params.source`` into ``out_dir`` (written atomically); return its card."""
    if params.source == "folder":
        from trainyard.sources.folder import prepare_folder

        return prepare_folder(params, out_dir, seed, max_image_pixels)
    from trainyard.sources.fashion_mnist import prepare_fashion_mnist

    return prepare_fashion_mnist(raw_dir, out_dir, params, seed)
